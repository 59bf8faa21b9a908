"""Does a batch slow interactive users? 16 interactive streams (closed loop, each sends its
next streamed chat request when the last ends) for ``--seconds``, alone and beside a
``--lines``-line batch submitted through the SDK, in ``--pairs`` pairs of the two runs whose
order alternates (alone first, then beside first, ...) so that both meet the machine's load in
turn; TTFT p50/p99 of the streams in each run, how each batch went (lines answered while the
streams ran, time to complete, each answered once), and over the pairs: each pair's p99 ratio
(median, range), the pooled p99 ratio (every beside request against every alone one) and a
90% bootstrap interval of it over the pairs.

Run: ``python -m bench.batch_ttft [--lines 1000] [--streams 16] [--seconds 30] [--pairs 6]
[--processes]``
(its own nats-server, SQLite under a temporary directory, one FAKE worker, the gateway with its
batch runner). By default the router, worker and gateway run in this process, on the event loop
of the bench's own clients; with ``--processes`` each is a process of its own (``strait router``,
``strait worker``, ``strait gateway``: the processes ``strait up`` starts,
``bench.support.procs.ProcessFleet``; the batch runner is ``strait batch``, niced, as
``strait up`` runs it, or the gateway's own with ``--runner gateway``), and the table adds each
process's CPU seconds in each run (``/proc``), which says where the batch's work lands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import percentile


async def streams(
    base: str, key: str, n: int, seconds: float, max_tokens: int, seed: int
) -> list[float]:
    """TTFT (ms) of every request the ``n`` closed-loop streams completed within ``seconds``."""
    from openai import AsyncOpenAI

    ttfts: list[float] = []
    deadline = time.monotonic() + seconds

    async def one(i: int, c: AsyncOpenAI) -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            first: float | None = None
            stream = await c.chat.completions.create(
                model="auto",
                messages=[{"role": "user", "content": f"user {i}: tell me about rivers"}],
                max_tokens=max_tokens,
                seed=seed,
                stream=True,
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            if first is not None:
                ttfts.append(first * 1e3)

    async with AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60) as c:
        await asyncio.gather(*(one(i, c) for i in range(n)))
    return ttfts


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def config_toml(args: argparse.Namespace) -> str:
    """The fleet's settings: one FAKE pool, the batch runner's in-flight cap, no rate limit."""
    return f"""
[gateway]
response_cache_enabled = false
default_rpm = 1000000000
default_tpm = 1000000000
[batch]
max_inflight = {args.batch_inflight}
[fake_engine]
per_token_s = {args.per_token_s}
[engine]
max_num_seqs = {args.capacity}
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""


async def measure(args: argparse.Namespace, tmp: Path, nats_url: str) -> list[dict[str, Any]]:
    """The pairs of runs on an in-process fleet (one event loop with the clients)."""
    from bench.support.fleet import GatewayFleet
    from bench.support.services import isolated_settings
    from libs.backend.fake import FakeBackend
    from libs.db.keys import ensure_dev_key

    s = isolated_settings(tmp, nats_url)
    s.pools[0].model, s.pools[0].backend = "fake-model", "fake"
    s.fake_engine.per_token_s = args.per_token_s
    s.gateway.response_cache_enabled = False
    s.batch.max_inflight = args.batch_inflight
    s.gateway.default_rpm = s.gateway.default_tpm = 10**9
    key = await ensure_dev_key(s)
    async with GatewayFleet(s) as fleet:
        await fleet.add_worker(
            "w1", backend=FakeBackend(s.fake_engine, "fake-model", capacity=args.capacity)
        )
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        return await runs(args, base, key, {})


def measure_processes(args: argparse.Namespace, tmp: Path, nats_url: str) -> list[dict[str, Any]]:
    """The pairs of runs on a fleet of processes (router, worker, gateway), SQLite in ``tmp``."""
    from bench.support.procs import ProcessFleet
    from bench.support.services import isolated_settings
    from libs.db.keys import ensure_dev_key

    s = isolated_settings(tmp, nats_url)  # the same state dir and database as the processes
    fleet = ProcessFleet(tmp, nats_url, config_toml(args), ready_timeout_s=120)
    if args.runner == "process":  # as `strait up` runs it (batch.runner_process)
        fleet.env["STRAIT_BATCH__RUNNER_ENABLED"] = "false"  # the gateway's; `strait batch` runs
        fleet.extra_services.append(("batch", "batch", {}))
    with fleet:
        key = asyncio.run(ensure_dev_key(s))
        pids = {name: p.pid for name, p in fleet.procs.items()}
        return asyncio.run(runs(args, fleet.base_url, key, pids))


async def runs(
    args: argparse.Namespace, base: str, key: str, pids: dict[str, int]
) -> list[dict[str, Any]]:
    """Warm up, then ``args.pairs`` pairs of runs: the streams alone and beside a batch, in
    alternating order (alone first in even pairs), each with the load average around it and,
    with ``pids``, the processes' CPU seconds."""
    await streams(base, key, args.streams, 2.0, args.max_tokens, args.seed)  # warm-up
    pairs = []
    for i in range(args.pairs):
        pair: dict[str, Any] = {}
        for name in ("alone", "beside") if i % 2 == 0 else ("beside", "alone"):
            load0, c0 = os.getloadavg()[0], cpu_s(pids)
            if name == "alone":
                run: dict[str, Any] = {
                    "ttft": await streams(
                        base, key, args.streams, args.seconds, args.max_tokens, args.seed
                    )
                }
            else:
                run = await beside_a_batch(args, base, key, f"{i}")
            c1 = cpu_s(pids)
            run["load"] = (round(load0, 1), round(os.getloadavg()[0], 1))
            run["cpu"] = {n: round(c1[n] - c0[n], 1) for n in pids}
            pair[name] = run
        pairs.append(pair)
    return pairs


async def beside_a_batch(args: argparse.Namespace, base: str, key: str, tag: str) -> dict[str, Any]:
    """Submit a batch with the SDK, run the streams beside it, wait until it is done; the
    streams' TTFTs and how the batch went (each line answered once)."""
    from openai import AsyncOpenAI

    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "auto",
                "messages": [{"role": "user", "content": f"summarise document {tag}-{i}"}],
                "max_tokens": args.batch_tokens,
                "seed": args.seed,
            },
        }
        for i in range(args.lines)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as c:
        f = await c.files.create(file=("batch.jsonl", data), purpose="batch")
        t0 = time.monotonic()
        batch = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        ttft = await streams(base, key, args.streams, args.seconds, args.max_tokens, args.seed)
        b = await c.batches.retrieve(batch.id)
        during = b.request_counts.completed if b.request_counts else 0
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.2)
            b = await c.batches.retrieve(batch.id)
        batch_s = time.monotonic() - t0
        assert b.output_file_id is not None, b
        text = (await c.files.content(b.output_file_id)).text
        ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
    return {
        "ttft": ttft,
        "batch": {
            "status": b.status,
            "answered_during_streams": during,
            "seconds_to_complete": round(batch_s, 1),
            "output_lines": len(ids),
            "distinct": len(set(ids)),
            "failed": b.request_counts.failed if b.request_counts else None,
        },
    }


def pooled_ratio(pairs: list[dict[str, Any]]) -> float:
    """TTFT p99 of every beside run's requests over that of every alone run's."""
    alone = [x for p in pairs for x in p["alone"]["ttft"]]
    beside = [x for p in pairs for x in p["beside"]["ttft"]]
    return percentile(beside, 99) / percentile(alone, 99)


def summary(pairs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """Each pair's p99 ratio (median, range), the pooled p99 ratio and a 90% interval of it
    from resampling the pairs (bootstrap, ``seed``): the pairs share the machine's load in
    turn, so the pooled ratio is what the batch costs, and the interval what the load lets
    this many pairs say about it."""
    ratios = sorted(
        percentile(p["beside"]["ttft"], 99) / percentile(p["alone"]["ttft"], 99) for p in pairs
    )
    rng = random.Random(seed)
    boot = sorted(pooled_ratio(rng.choices(pairs, k=len(pairs))) for _ in range(2000))
    return {
        "pairs": len(pairs),
        "ratio_median": round(statistics.median(ratios), 2),
        "ratio_min": round(ratios[0], 2),
        "ratio_max": round(ratios[-1], 2),
        "pooled_ratio": round(pooled_ratio(pairs), 2),
        "pooled_ratio_90": (round(boot[100], 2), round(boot[1899], 2)),
        "pairs_within_1_2": sum(r <= 1.2 for r in ratios),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_ttft", description=__doc__)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of an interactive answer")
    p.add_argument("--batch-tokens", type=int, default=16, help="tokens of a batch line's answer")
    p.add_argument("--per-token-s", type=float, default=0.01, help="the FAKE worker's step")
    p.add_argument("--batch-inflight", type=int, default=16, help="batch.max_inflight")
    p.add_argument("--pairs", type=int, default=6, help="alone/beside pairs, order alternating")
    p.add_argument("--seed", type=int, default=39, help="the requests' seed and the bootstrap's")
    p.add_argument("--json", default="", help="write every run's TTFTs and batch here")
    p.add_argument("--capacity", type=int, default=64, help="the FAKE worker's slots")
    p.add_argument("--processes", action="store_true", help="router, worker, gateway as processes")
    p.add_argument(
        "--runner",
        choices=("gateway", "process"),
        default="process",
        help="with --processes: the batch runner in the gateway, or `strait batch`",
    )
    args = p.parse_args(argv)
    from bench.support.services import nats_server

    with tempfile.TemporaryDirectory() as d, nats_server(Path(d)) as url:
        if args.processes:
            pairs = measure_processes(args, Path(d), url)
        else:
            pairs = asyncio.run(measure(args, Path(d), url))
    print(
        "| pair | run | load before → after | requests | TTFT p50 ms | TTFT p99 ms | p99 ratio "
        "| batch |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for i, pair in enumerate(pairs):
        ratio = percentile(pair["beside"]["ttft"], 99) / percentile(pair["alone"]["ttft"], 99)
        for name in ("alone", "beside") if i % 2 == 0 else ("beside", "alone"):
            r, t = pair[name], pair[name]["ttft"]
            b = r.get("batch", {})
            print(
                f"| {i} | {name} | {r['load'][0]} → {r['load'][1]} | {len(t)} "
                f"| {percentile(t, 50):.1f} | {percentile(t, 99):.1f} "
                f"| {f'{ratio:.2f}x' if name == 'beside' else ''} "
                f"| {json.dumps(b) if b else ''} |"
            )
    print("\nsummary:", json.dumps(summary(pairs, args.seed)))
    if args.processes:
        print(
            "CPU seconds per process, alone -> beside:",
            json.dumps(
                [
                    {n: [p["alone"]["cpu"][n], p["beside"]["cpu"][n]] for n in p["alone"]["cpu"]}
                    for p in pairs
                ]
            ),
        )
    if args.json:
        Path(args.json).write_text(json.dumps(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
