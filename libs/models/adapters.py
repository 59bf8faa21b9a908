"""The fleet's catalogue of LoRA adapters: which pool serves an adapter named in ``model``.

Read by the router (``Router.choose_pool``: an adapter's name picks its pool) and the gateway
(``/v1/models`` lists adapters with their base as ``parent``). An adapter is a directory
``<pool.adapters_dir>/<name>/`` holding PEFT's ``adapter_config.json`` (the engine reads and
checks it, libs/engine/lora), or a name a worker of the pool announces as loaded in its beats
(``WorkerBeat.adapters``, loaded at run time from elsewhere). Directories are listed again at
most every ``LIST_TTL_S``. No torch here: the gateway image has none.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from libs.settings import Settings

# PEFT's config file name (libs/engine/lora/adapter.py reads it): a directory without one is
# not an adapter.
ADAPTER_CONFIG = "adapter_config.json"
# Seconds a listing of the pools' adapter directories is reused.
LIST_TTL_S = 5.0


def list_dir(directory: str | Path) -> list[str]:
    """Adapter names in ``directory`` (its subdirectories holding a config), sorted."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    return sorted(p.name for p in entries if (p / ADAPTER_CONFIG).is_file())


class AdapterCatalogue:
    """Adapter name → pool, from the pools' ``adapters_dir`` and the workers' beats."""

    def __init__(self, settings: Settings) -> None:
        self.dirs = {p.name: p.adapters_dir for p in settings.pools if p.adapters_dir}
        self._listed: dict[str, str] = {}
        self._listed_at = float("-inf")

    def listed(self) -> dict[str, str]:
        """Adapters on disk: name → pool (the first pool, in settings order, listing it)."""
        now = time.monotonic()
        if now - self._listed_at >= LIST_TTL_S:
            out: dict[str, str] = {}
            for pool, directory in self.dirs.items():
                for name in list_dir(directory):
                    out.setdefault(name, pool)
            self._listed, self._listed_at = out, now
        return self._listed

    def all(self, announced: Iterable[tuple[str, list[str]]] = ()) -> dict[str, str]:
        """Adapters on disk and those ``announced`` as (pool, loaded adapters) by beats."""
        out = dict(self.listed())
        for pool, names in announced:
            for name in names:
                out.setdefault(name, pool)
        return out
