"""Throughput of the same prompts over NATS (examples/batch_submit.py) and over HTTP (gateway).

    .venv/bin/python -m bench.nats_vs_http --n 1000 --concurrency 64 --max-tokens 16

Starts a nats-server, a router, FAKE-engine workers and the gateway in this process (the shape
of the two paths, not a model's speed: with ``--per-token-ms 0`` the workers cost nothing and
what is measured is the serving overhead of each path). Then runs the prompts through
``batch_submit.run`` over NATS and through ``POST /v1/completions`` with the same concurrency,
and prints requests/s both ways. Client, fleet and gateway share one event loop and one core,
so the figures compare the paths with each other, not with a deployed fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.support.fleet import InProcessFleet
from bench.support.services import nats_server
from examples import batch_submit
from libs.backend.fake import FakeBackend
from libs.client import StraitClient
from libs.settings import Settings


def fleet_settings(tmp: Path, url: str, per_token_s: float) -> Settings:
    s = Settings(state_dir=str(tmp / "state"))
    s.nats.url = url
    s.database.url = f"sqlite+aiosqlite:///{tmp / 'strait.db'}"
    s.gateway.auth_enabled = False
    s.gateway.ledger_enabled = False
    s.gateway.response_cache_enabled = False
    s.gateway.max_inflight = 4096
    s.gateway.shed_queue_depth = 100_000
    s.gateway.default_rpm = 10**9
    s.gateway.default_tpm = 10**12
    s.pools[0].model = "fake-model"
    s.pools[0].backend = "fake"
    s.fake_engine.per_token_s = per_token_s
    s.fake_engine.per_prompt_token_s = 0.0
    s.router.metrics_port = 0
    s.router.max_pool_queue = 100_000
    s.worker.metrics_port = 0
    s.worker.max_waiting = 100_000
    return s


async def http_batch(
    base: str, items: list[dict[str, Any]], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    slots = asyncio.Semaphore(concurrency)
    ok = 0
    errors: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:

        async def one(item: dict[str, Any]) -> None:
            nonlocal ok
            body = {"model": "default", "prompt": item["prompt"], "max_tokens": max_tokens}
            async with slots:
                r = await http.post("/v1/completions", json=body)
            ok += r.status_code == 200
            if r.status_code != 200:
                errors[f"{r.status_code} {r.json().get('error', {}).get('code')}"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(x) for x in items))
        took = time.perf_counter() - t0
    if errors:
        print(f"HTTP errors: {dict(errors)}")
    return ok, took


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d, nats_server(Path(d)) as url:
        s = fleet_settings(Path(d), url, args.per_token_ms / 1000)
        async with InProcessFleet(s) as fleet:
            for i in range(args.workers):
                backend = FakeBackend(s.fake_engine, "fake-model", capacity=args.concurrency)
                await fleet.add_worker(f"w{i}", backend=backend)
            base = await fleet.gateway()
            await fleet.wait_workers(args.workers)
            items = batch_submit.load_prompts(None, args.n)
            warm = items[: min(50, len(items))]
            async with StraitClient.from_settings(s) as client:
                await batch_submit.run(
                    client, warm, f"{d}/warm.jsonl", max_tokens=2, progress=False
                )
                await http_batch(base, warm, args.concurrency, 2)
                nats_stats = await batch_submit.run(
                    client, items, f"{d}/nats.jsonl", concurrency=args.concurrency,
                    max_tokens=args.max_tokens, model="default", progress=False,
                )  # fmt: skip
            http_ok, http_s = await http_batch(base, items, args.concurrency, args.max_tokens)
            for ctx in fleet._ctxs:  # see bench.support.fleet.running_fleet
                ctx.stopping.set()
            await asyncio.wait(fleet._tasks, timeout=1.0)
            for t in fleet._tasks:
                t.cancel()
    print(
        f"{args.n} prompts, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
        f"{args.workers} FAKE workers, per_token {args.per_token_ms} ms"
    )
    print("| path | ok | seconds | requests/s |\n| --- | --- | --- | --- |")
    print(
        f"| NATS (batch_submit) | {nats_stats.ok} | {nats_stats.seconds:.2f} | {nats_stats.requests_per_s:.0f} |"
    )
    print(f"| HTTP (/v1/completions) | {http_ok} | {http_s:.2f} | {args.n / http_s:.0f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-token-ms", type=float, default=0.0)
    asyncio.run(bench(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
