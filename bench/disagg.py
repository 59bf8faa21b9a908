"""Disaggregation benchmark on the real model: what the KV handoff costs and what it buys.

Run: ``.venv/bin/python -m bench.disagg`` (``--help`` for options). It starts its own fleet as
processes on the NATS server at ``NATS_URL`` (or one it starts from the wheel) under a subject
prefix and stream names of its own: a router, the prefix-cache service, pool ``agg`` (one
aggregated worker, ``--agg-threads`` torch threads) and pool ``dis`` (one prefill and one decode
worker, ``--dis-threads`` each, so both pools get the same cores). It talks to them over NATS
with the client library (no gateway, no HTTP), one pool at a time, and measures

1. transport: raw NATS loopback throughput of KV-sized chunks (MB/s), and the handoffs' own
   throughput from the prefill worker's metrics (bytes / seconds from first token to commit);
2. TTFT of ``--prompt-tokens``-token prompts (all misses), aggregated vs disaggregated;
3. TTFT of a prompt whose ``--prompt-tokens``-token prefix is cached vs a miss, per pool;
4. inter-token latency of ``--streams`` running streams, alone and while long prompts arrive
   every ``--long-every-s`` seconds, aggregated vs disaggregated.

Prints a table and writes JSON to ``bench/results/``. The machine's cores are shared by every
process of the fleet: compare the two pools measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.stats import percentile
from libs.client import StraitClient
from libs.settings import Settings, get_settings
from services.supervisor.children import Child
from services.supervisor.fleet import Fleet

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
PREFILL_METRICS_PORT = 9391  # the bench's prefill worker's /metrics (handoff counters)


def fleet_config(args: argparse.Namespace) -> str:
    return f"""
[engine]
kv_cache_bytes = {args.kv_cache_mb * 2**20}
max_num_seqs = 32
max_num_batched_tokens = 512
[cache]
enabled = true
metrics_port = 0
[router]
metrics_port = 0
[[pools]]
name = "agg"
model = "{MODEL}"
mode = "aggregated"
[[pools]]
name = "dis"
model = "{MODEL}"
mode = "disaggregated"
"""


def start_fleet(args: argparse.Namespace, tmp: Path) -> tuple[Fleet, Settings, dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    (tmp / "strait.toml").write_text(fleet_config(args))
    names = {
        "STRAIT_CONFIG": str(tmp / "strait.toml"),
        "STRAIT_NATS__SUBJECT_PREFIX": f"bench{tag}.v1",
        "STRAIT_NATS__REQUESTS_STREAM": f"BENCH_{tag}_REQUESTS",
        "STRAIT_NATS__EVENTS_STREAM": f"BENCH_{tag}_EVENTS",
        "STRAIT_NATS__KV_EVENTS_STREAM": f"BENCH_{tag}_KV_EVENTS",
        "STRAIT_NATS__CACHE_EVENTS_STREAM": f"BENCH_{tag}_CACHE_EVENTS",
        "STRAIT_TELEMETRY__LOG_LEVEL": "WARNING",
    }
    os.environ.update(names)
    get_settings.cache_clear()
    settings = get_settings()
    fleet = Fleet(settings)
    fleet.ensure_nats()
    cli = [sys.executable, "-m", "services.cli"]

    def child(name: str, command: str, **env: str) -> None:
        fleet.children.append(Child(name, [*cli, command], fleet.child_env(**env)))

    child("router", "router")
    child("cache", "cache")
    child(
        "agg",
        "decode",
        STRAIT_WORKER__POOL="agg",
        STRAIT_WORKER__WORKER_ID=f"agg-{tag}",
        STRAIT_ENGINE__NUM_THREADS=str(args.agg_threads),
    )
    child(
        "prefill",
        "prefill",
        STRAIT_WORKER__POOL="dis",
        STRAIT_WORKER__WORKER_ID=f"dis-p-{tag}",
        STRAIT_WORKER__METRICS_PORT=str(PREFILL_METRICS_PORT),
        STRAIT_ENGINE__NUM_THREADS=str(args.dis_threads),
    )
    child(
        "decode",
        "decode",
        STRAIT_WORKER__POOL="dis",
        STRAIT_WORKER__ROLE="decode",
        STRAIT_WORKER__WORKER_ID=f"dis-d-{tag}",
        STRAIT_ENGINE__NUM_THREADS=str(args.dis_threads),
    )
    fleet.start_all()
    return fleet, settings, names


# ---------------------------------------------------------------- prompts


class Prompts:
    """Token-id prompts of the real tokenizer: unique heads make misses, shared heads hits."""

    def __init__(self, seed: int) -> None:
        from transformers import AutoTokenizer

        from libs.models import prepare_model

        tok = AutoTokenizer.from_pretrained(prepare_model(MODEL, get_settings(), progress=False))
        text = (
            "The river leaves the mountains in a narrow gorge and widens through fields of "
            "wheat, past villages, bridges and mills, until it meets the sea at a busy port. "
        )
        self.ids: list[int] = tok(text * 400)["input_ids"]
        self.rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        """``n`` tokens starting at a random offset: a prefix no earlier prompt shares."""
        start = self.rng.randrange(len(self.ids) - n)
        head = [self.rng.randrange(1000, 40000) for _ in range(16)]
        return (head + self.ids[start : start + n])[:n]


# ---------------------------------------------------------------- measurements


async def ttft(client: StraitClient, pool: str, ids: list[int], max_tokens: int = 4) -> float:
    t0 = time.perf_counter()
    async with client.generate(
        prompt_token_ids=ids, model=pool, max_tokens=max_tokens, temperature=0.0
    ) as gen:
        first = None
        async for d in gen:
            if first is None and d.token_ids:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def stream_gaps(client: StraitClient, pool: str, ids: list[int], tokens: int) -> list[float]:
    gaps, last = [], None
    async with client.generate(
        prompt_token_ids=ids, model=pool, max_tokens=tokens, temperature=0.0, ignore_eos=True
    ) as gen:
        async for d in gen:
            now = time.perf_counter()
            if last is not None and d.token_ids:
                gaps.append(now - last)
            if d.token_ids:
                last = now
    return gaps


async def itl_under_load(
    client: StraitClient, pool: str, prompts: Prompts, args: argparse.Namespace, long: bool
) -> dict[str, float]:
    streams = [
        asyncio.create_task(stream_gaps(client, pool, prompts.make(32), args.stream_tokens))
        for _ in range(args.streams)
    ]
    longs: list[asyncio.Task[float]] = []
    while long and not all(t.done() for t in streams):
        longs.append(asyncio.create_task(ttft(client, pool, prompts.make(args.prompt_tokens), 1)))
        await asyncio.sleep(args.long_every_s)
    gaps = [g for t in await asyncio.gather(*streams) for g in t]
    await asyncio.gather(*longs)
    return {
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "long_prompts": len(longs),
    }


async def transport_mb_s(settings: Settings, total_mb: int) -> float:
    """Raw loopback throughput: chunks of the handoff's size, one publisher, one subscriber."""
    import nats

    from libs.wire.kv_cache_client import chunk_limit

    pub, sub_nc = await nats.connect(settings.nats.url), await nats.connect(settings.nats.url)
    size = chunk_limit(pub, settings, settings.handoff.chunk_bytes)
    n = max(total_mb * 2**20 // size, 1)
    got, done = 0, asyncio.Event()

    async def on_msg(msg: Any) -> None:
        nonlocal got
        got += 1
        if got == n:
            done.set()

    subject = f"{settings.nats.subject_prefix}.bench.transport"
    await sub_nc.subscribe(subject, cb=on_msg, pending_bytes_limit=2 * n * size)
    await sub_nc.flush()
    piece = os.urandom(size)
    t0 = time.perf_counter()
    for _ in range(n):
        await pub.publish(subject, piece)
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - t0
    await pub.drain()
    await sub_nc.drain()
    return n * size / 2**20 / elapsed


def handoff_totals() -> tuple[float, float, float]:
    """(MB, seconds, handoffs) so far, from the prefill worker's handoff metrics."""
    text = httpx.get(f"http://127.0.0.1:{PREFILL_METRICS_PORT}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in (
            'strait_handoff_bytes_total{side="prefill"}',
            "strait_handoff_seconds_sum",
            "strait_handoff_seconds_count",
        ):
            if line.startswith(name + " "):
                values[name] = float(line.split()[-1])
    return (
        values.get('strait_handoff_bytes_total{side="prefill"}', 0.0) / 2**20,
        values.get("strait_handoff_seconds_sum", 0.0),
        values.get("strait_handoff_seconds_count", 0.0),
    )


async def wait_pools(client: StraitClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pool in ("agg", "dis"):
        while True:
            try:
                await client.complete(prompt_token_ids=[1, 2, 3], model=pool, max_tokens=2)
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"pool {pool} did not come up: {e!r}") from None
                await asyncio.sleep(1.0)


async def measure(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    prompts = Prompts(args.seed)
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, Any] = {"args": given, "model": MODEL, "cpus": os.cpu_count()}
    async with StraitClient.from_settings(settings, first_token_timeout_s=300) as client:
        print("waiting for the fleet (model loads)...", flush=True)
        await wait_pools(client, 300)
        print("transport: raw NATS loopback...", flush=True)
        report["transport_mb_s"] = await transport_mb_s(settings, args.transport_mb)
        for pool in ("agg", "dis"):
            r: dict[str, Any] = report.setdefault(pool, {})
            print(f"[{pool}] TTFT of {args.prompt_tokens}-token prompts (misses)...", flush=True)
            before = handoff_totals()
            r["ttft_miss_s"] = [
                await ttft(client, pool, prompts.make(args.prompt_tokens)) for _ in range(args.reps)
            ]
            if pool == "dis":  # handoffs of whole prompts (the decode worker holds none)
                mb, secs, n = (a - b for a, b in zip(handoff_totals(), before, strict=True))
                report["handoff"] = {
                    "mb_s": mb / secs if secs else 0.0,
                    "mb_per_handoff": mb / max(n, 1),
                    "s_per_handoff": secs / max(n, 1),
                }
            print(f"[{pool}] TTFT of a cached {args.prompt_tokens}-token prefix...", flush=True)
            hits = []
            for _ in range(args.reps):
                shared = prompts.make(args.prompt_tokens)
                await ttft(client, pool, shared + prompts.make(16))  # stores the prefix
                hits.append(await ttft(client, pool, shared + prompts.make(16)))
            r["ttft_hit_s"] = hits
            print(f"[{pool}] inter-token latency of {args.streams} streams...", flush=True)
            r["alone"] = await itl_under_load(client, pool, prompts, args, long=False)
            r["with_long_prompts"] = await itl_under_load(client, pool, prompts, args, long=True)
    return report


def table(report: dict[str, Any]) -> str:
    med = statistics.median
    a, d = report["agg"], report["dis"]
    rows = [
        ("metric", "aggregated", "disaggregated"),
        (
            f"TTFT {report['args']['prompt_tokens']}-token miss, median s",
            f"{med(a['ttft_miss_s']):.3f}",
            f"{med(d['ttft_miss_s']):.3f}",
        ),
        ("TTFT prefix hit, median s", f"{med(a['ttft_hit_s']):.3f}", f"{med(d['ttft_hit_s']):.3f}"),
        (
            "hit / miss TTFT",
            f"{med(a['ttft_hit_s']) / med(a['ttft_miss_s']):.2f}",
            f"{med(d['ttft_hit_s']) / med(d['ttft_miss_s']):.2f}",
        ),
        (
            "ITL p99 ms, streams alone",
            f"{a['alone']['itl_p99_ms']:.1f}",
            f"{d['alone']['itl_p99_ms']:.1f}",
        ),
        (
            "ITL p99 ms, with long prompts arriving",
            f"{a['with_long_prompts']['itl_p99_ms']:.1f}",
            f"{d['with_long_prompts']['itl_p99_ms']:.1f}",
        ),
        (
            "ITL p50 ms, with long prompts arriving",
            f"{a['with_long_prompts']['itl_p50_ms']:.1f}",
            f"{d['with_long_prompts']['itl_p50_ms']:.1f}",
        ),
    ]
    h = report["handoff"]
    lines = [f"| {' | '.join(r)} |" for r in rows]
    lines.insert(1, "| --- | --- | --- |")
    lines.append("")
    lines.append(
        f"handoff: {h['mb_s']:.0f} MB/s ({h['mb_per_handoff']:.1f} MB, "
        f"{1000 * h['s_per_handoff']:.1f} ms per handoff incl. import); raw NATS loopback "
        f"{report['transport_mb_s']:.0f} MB/s"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.disagg", description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--reps", type=int, default=4, help="prompts per TTFT figure")
    p.add_argument("--streams", type=int, default=4, help="running streams for the ITL figure")
    p.add_argument("--stream-tokens", type=int, default=96, help="output tokens of each stream")
    p.add_argument("--long-every-s", type=float, default=1.5, help="long-prompt arrival gap")
    p.add_argument("--agg-threads", type=int, default=2, help="torch threads, aggregated worker")
    p.add_argument("--dis-threads", type=int, default=1, help="torch threads, each dis worker")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV budget of each worker")
    p.add_argument("--transport-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/disagg-<ts>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fleet, settings, _ = start_fleet(args, Path(tmp))
        try:
            report = asyncio.run(measure(args, settings))
        finally:
            fleet.stop_all()
    print(table(report))
    out = args.out or RESULTS_DIR / f"disagg-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
