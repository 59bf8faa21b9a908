"""Compile each pool's forward once, ahead of its workers (``engine.compile``'s start-up, paid once).

``strait up`` calls :func:`warm_pools` before it starts the workers: for every engine pool with
``compile`` on whose compiled graphs this machine has not built yet, it runs this module in a
child process (``python -m libs.models.warm POOL``), which builds the engine exactly as a
worker would and compiles both graphs, showing a progress bar. The graphs are saved under
``Settings.compile_cache_dir`` (``TORCHINDUCTOR_CACHE_DIR``, set for every child of
``strait up``): whole, ahead of time, with ``engine.compile_aot`` (libs/engine/aot.py), where
the workers load them in seconds; otherwise as inductor's cache, which spares the workers
inductor's work but not dynamo's tracing (tens of seconds instead of minutes).

Whether a pool is warm is a marker file named by :func:`warm_key`: the model's files and
:func:`libs.engine.digest.engine_digest` (the pool's engine settings, torch's and transformers' versions, this
CPU's features, the source of every module that shapes the compiled graph). Anything else
changing makes a new key and a new warm-up. The marker only decides whether to warm ahead; the
graphs' own keys (libs/engine/aot.py's, or inductor's) decide what is reused, so a stale or
missing graph is recompiled, never misused.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from libs.engine.config import EngineSettings, SpeculativeSettings
from libs.engine.digest import engine_digest
from libs.settings import PoolSettings, Settings

# The progress bar's scale: a first compile of SmolLM2's two graphs on 2 cores (5-8 min).
EXPECTED_COMPILE_S = 420
# KV budget of the warm-up engine: the cache's block count is a symbolic size of the graphs,
# so a small cache compiles the graphs a worker's large one uses.
WARM_KV_BYTES = 64 * 2**20


def warm_key(settings: Settings, pool: PoolSettings, model_dir: Path) -> str:
    """A short hash of everything that decides the pool's compiled graphs (see the module)."""
    h = hashlib.sha256(engine_digest(settings.engine_for(pool)))
    for f in sorted(model_dir.glob("*.json")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _marker(settings: Settings, pool: PoolSettings, model_dir: Path) -> Path:
    return settings.compile_cache_dir / f"warm-{pool.name}-{warm_key(settings, pool, model_dir)}"


def needs_warm(settings: Settings, pool: PoolSettings) -> bool:
    """True when ``pool`` compiles and its graphs for this machine have not been built."""
    if pool.backend != "engine" or not settings.engine_for(pool).compile:
        return False
    from libs.models import prepare_model

    return not _marker(settings, pool, prepare_model(pool.model, settings)).exists()


def warm_pools(settings: Settings, env: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Warm every pool that needs it, one child process each (called by ``strait up``);
    raises ``RuntimeError`` when a warm-up fails."""
    for pool in settings.pools:
        if not needs_warm(settings, pool):
            continue
        say(f"pool {pool.name}: compiling the forward once for this machine (cached after)")
        cmd = [sys.executable, "-m", "libs.models.warm", pool.name]
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            raise RuntimeError(f"compiling pool {pool.name}'s forward failed (see above)")


def _progress(stop: threading.Event, label: str) -> None:
    """A bar over the expected compile time (inductor reports no progress of its own)."""
    from tqdm import tqdm

    fmt = "{l_bar}{bar}| {elapsed}"
    with tqdm(total=EXPECTED_COMPILE_S, desc=label, unit="s", bar_format=fmt) as bar:
        started = time.monotonic()
        while not stop.wait(1.0):
            bar.n = min(int(time.monotonic() - started), EXPECTED_COMPILE_S - 1)
            bar.refresh()
        bar.n = EXPECTED_COMPILE_S
        bar.refresh()


def warm_kv_bytes(model_dir: Path, engine: EngineSettings) -> int:
    """The warm-up engine's KV budget: ``WARM_KV_BYTES`` for the cache, plus what the pool's
    LoRA slots (``engine.max_loras``) take out of the budget first (float32, unfused
    projections: never less than the engine takes), so a pool with adapters warms too."""
    if not engine.max_loras:
        return WARM_KV_BYTES
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from libs.engine.lora.layers import bank_bytes

    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return WARM_KV_BYTES + bank_bytes(model, engine, torch.float32)


def main(argv: list[str] | None = None) -> int:
    """``python -m libs.models.warm POOL``: build POOL's engine with ``compile`` on, as its
    workers will, then write the pool's marker."""
    from libs.engine.engine import LLMEngine
    from libs.models import prepare_model
    from libs.settings import get_settings, model_identity

    args = sys.argv[1:] if argv is None else argv
    settings = get_settings()
    pool = next((p for p in settings.pools if p.name == args[0]), None)
    if pool is None:
        print(f"no pool named {args[0]!r}", file=sys.stderr)
        return 2
    model_dir = prepare_model(pool.model, settings)
    # Speculation's draft model is never compiled; the target's graphs are the same without it.
    engine = settings.engine_for(pool)
    engine = engine.model_copy(
        update={
            "kv_cache_bytes": warm_kv_bytes(model_dir, engine),
            "speculative": SpeculativeSettings(),
            "compile_background": False,  # this process is the compile
        }
    )
    if engine.num_threads:  # the workers' thread count: inductor's kernels depend on it
        import torch

        torch.set_num_threads(engine.threads())
    stop = threading.Event()
    bar = threading.Thread(target=_progress, args=(stop, f"compile {pool.name}"), daemon=True)
    bar.start()
    try:
        LLMEngine.from_path(model_dir, engine, model_identity(pool.model, engine))
    finally:
        stop.set()
        bar.join()
    marker = _marker(settings, pool, model_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
