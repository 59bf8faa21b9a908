"""Does a batch slow interactive users? 16 interactive streams (closed loop, each sends its
next streamed chat request when the last ends) for ``--seconds``, first alone, then beside a
``--lines``-line batch submitted through the SDK; TTFT p50/p99 of the streams in each run, and
how the batch went (lines answered while the streams ran, time to complete, each answered once).

Run: ``python -m bench.batch_ttft [--lines 1000] [--streams 16] [--seconds 30] [--processes]``
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
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import percentile


async def streams(base: str, key: str, n: int, seconds: float, max_tokens: int) -> list[float]:
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


async def measure(args: argparse.Namespace, tmp: Path, nats_url: str) -> dict[str, Any]:
    """The two runs on an in-process fleet (one event loop with the clients)."""
    from bench.support.fleet import GatewayFleet
    from bench.support.services import isolated_settings
    from libs.db.keys import ensure_dev_key
    from libs.fake_engine import FakeBackend

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


def measure_processes(args: argparse.Namespace, tmp: Path, nats_url: str) -> dict[str, Any]:
    """The two runs on a fleet of processes (router, worker, gateway), SQLite in ``tmp``."""
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
) -> dict[str, Any]:
    """Warm up, the streams alone, then beside a batch; with ``pids``, the processes' CPU."""
    from openai import AsyncOpenAI

    out: dict[str, Any] = {"cpu": {}}
    await streams(base, key, args.streams, 2.0, args.max_tokens)  # warm-up
    c0 = cpu_s(pids)
    alone = await streams(base, key, args.streams, args.seconds, args.max_tokens)
    c1 = cpu_s(pids)
    out["cpu"]["alone"] = {n: round(c1[n] - c0[n], 1) for n in pids}
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "auto",
                "messages": [{"role": "user", "content": f"summarise document {i}"}],
                "max_tokens": args.batch_tokens,
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
        c0 = cpu_s(pids)
        beside = await streams(base, key, args.streams, args.seconds, args.max_tokens)
        c1 = cpu_s(pids)
        out["cpu"]["beside"] = {n: round(c1[n] - c0[n], 1) for n in pids}
        b = await c.batches.retrieve(batch.id)
        during = b.request_counts.completed if b.request_counts else 0
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.2)
            b = await c.batches.retrieve(batch.id)
        batch_s = time.monotonic() - t0
        assert b.output_file_id is not None
        text = (await c.files.content(b.output_file_id)).text
        ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
    out["alone"] = alone
    out["beside"] = beside
    out["batch"] = {
        "status": b.status,
        "answered_during_streams": during,
        "seconds_to_complete": round(batch_s, 1),
        "output_lines": len(ids),
        "distinct": len(set(ids)),
        "failed": b.request_counts.failed if b.request_counts else None,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_ttft", description=__doc__)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of an interactive answer")
    p.add_argument("--batch-tokens", type=int, default=16, help="tokens of a batch line's answer")
    p.add_argument("--per-token-s", type=float, default=0.01, help="the FAKE worker's step")
    p.add_argument("--batch-inflight", type=int, default=16, help="batch.max_inflight")
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
            r = measure_processes(args, Path(d), url)
        else:
            r = asyncio.run(measure(args, Path(d), url))
    print(
        "| interactive streams | requests | TTFT p50 ms | TTFT p99 ms |\n| --- | --- | --- | --- |"
    )
    for name in ("alone", "beside"):
        t = r[name]
        print(f"| {name} | {len(t)} | {percentile(t, 50):.1f} | {percentile(t, 99):.1f} |")
    ratio = percentile(r["beside"], 99) / percentile(r["alone"], 99)
    print(f"\nTTFT p99 beside the batch / alone: {ratio:.2f}x")
    print("batch:", json.dumps(r["batch"]))
    if r["cpu"].get("alone"):
        print("CPU seconds per process (alone -> beside):", json.dumps(r["cpu"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
