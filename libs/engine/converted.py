"""A model directory converted from a GGUF: the marker that says the conversion completed and
which file it came from. ``libs.models.convert`` writes it last; the engine reads it to load the
GGUF's quantized blocks beside the converted weights (``libs.engine.quant.gguf``). Here, in the
engine, so the reader does not import the converter (which imports the engine)."""

from __future__ import annotations

from pathlib import Path

# Written last into a converted directory: its presence means the conversion completed.
DONE_MARKER = ".strait-converted"
_SOURCE = "source="


def marker_text(gguf_path: str | Path) -> str:
    """The marker's content for a directory converted from ``gguf_path``."""
    return f"{_SOURCE}{gguf_path}\n"


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from (its marker's ``source=``), or None."""
    marker = Path(model_dir) / DONE_MARKER
    if not marker.exists():
        return None
    for line in marker.read_text().splitlines():
        if line.startswith(_SOURCE):
            path = Path(line.removeprefix(_SOURCE))
            return path if path.is_file() else None
    return None
