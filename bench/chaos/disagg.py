"""The scenarios of a disaggregated pool on the REAL engine (tiny random-weight model): SIGKILL a
decode worker, a prefill worker, or the prefix-cache service.
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.fleet import TINY_MODEL, Fleet, Opts, disagg_config_toml
from bench.chaos.load import DISAGG_MAX_TOKENS, DISAGG_PROMPTS, Load
from bench.chaos.measure import Runner, run_scenario


def disagg_fleet(tmp: Path, prefill_workers: int) -> dict[str, Any]:
    """run_scenario's fleet arguments for one disaggregated pool on the real engine: the tiny
    random-weight model saved under ``tmp/models``, ``prefill_workers`` prefill workers
    (``prefill``, ``prefill1``, ...: p0, p1, ...), two decode workers (``worker0``/w0,
    ``worker1``/w1), the prefix-cache service (``cache``), router and gateway."""
    from bench.support.tiny_models import save_tiny_model_dir

    models = tmp / "models"
    if not (models / TINY_MODEL / "config.json").exists():
        save_tiny_model_dir(models / TINY_MODEL)
    extra: list[tuple[str, str, dict[str, str]]] = [("cache", "cache", {})]
    for i in range(prefill_workers):
        extra.append((f"prefill{i or ''}", "prefill", {"STRAIT_WORKER__WORKER_ID": f"p{i}"}))
    return {
        "config": disagg_config_toml(prefill_workers),
        "extra_services": extra,
        "model": TINY_MODEL,
        "workers": 2,
        "ready_workers": 2 + prefill_workers,
        "worker_env": {i: {"STRAIT_WORKER__ROLE": "decode"} for i in range(2)},
        "env": {"STRAIT_MODELS__DIR": str(models.resolve()), "STRAIT_CACHE__ENABLED": "true"},
    }


async def disagg_logs(fleet: Fleet, load: Load) -> dict[str, Any]:
    """The warnings and errors the prefill workers, decode workers and cache service logged,
    and how many handoffs the decode workers admitted (evidence for the row)."""
    out: dict[str, Any] = {}
    for prefix, key in (
        ("prefill", "prefill_log"),
        ("worker", "decode_log"),
        ("cache", "cache_log"),
    ):
        lines = fleet.log_lines(prefix)
        out[key] = dict(
            Counter(
                str(r.get("msg"))
                for r in lines
                if str(r.get("level", "")).lower() in ("warning", "error", "critical")
            )
        )
        if prefix == "worker":
            out["handoffs_admitted"] = sum(1 for r in lines if r.get("msg") == "handoff admitted")
    return out


async def kill_decode(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool, real engine: SIGKILL the decode worker with the most running
    requests; its streams must migrate to the other decode worker."""
    name = "kill-decode"

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal(await fleet.busiest_worker(), signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=1)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


async def kill_prefill(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool with two prefill workers (p0, p1), real engine: SIGKILL the one with
    the most running requests; what it held before the handoff must be placed again."""
    name = "kill-prefill"

    async def fault(fleet: Fleet, load: Load) -> None:
        names = [n for n in fleet.procs if n.startswith("prefill")]
        load_of = {n: (await fleet.running(n)) or 0.0 for n in names}
        fleet.signal(max(names, key=lambda n: (load_of[n], n == "prefill")), signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=2)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


async def kill_cache(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool, real engine: SIGKILL the prefix-cache service and leave it down;
    prefill must go on without it (misses, not failures)."""
    name = "kill-cache"

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal("cache", signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=1)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


RUNNERS: dict[str, Runner] = {
    "kill-decode": kill_decode,
    "kill-prefill": kill_prefill,
    "kill-cache": kill_cache,
}
