"""Does a batch slow interactive users? 16 interactive streams (closed loop, each sends its
next streamed chat request when the last ends) for ``--seconds``, first alone, then beside a
``--lines``-line batch submitted through the SDK; TTFT p50/p99 of the streams in each run, and
how the batch went (lines answered while the streams ran, time to complete, each answered once).

Run: ``python -m bench.batch_ttft [--lines 1000] [--streams 16] [--seconds 30]`` (its own
nats-server and an in-process fleet: router, one FAKE worker, the gateway with its batch
runner, SQLite under a temporary directory). Everything but nats-server shares one event loop
with the bench's own clients, so on a small machine the loop's CPU is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def measure(args: argparse.Namespace, tmp: Path, nats_url: str) -> dict[str, Any]:
    from openai import AsyncOpenAI

    from bench.support.fleet import GatewayFleet
    from bench.support.services import isolated_settings
    from libs.db.keys import ensure_dev_key

    s = isolated_settings(tmp, nats_url)
    s.pools[0].model, s.pools[0].backend = "fake-model", "fake"
    s.fake_engine.per_token_s = args.per_token_s
    s.gateway.response_cache_enabled = False
    s.batch.max_inflight = args.batch_inflight
    s.gateway.default_rpm = s.gateway.default_tpm = 10**9
    key = await ensure_dev_key(s)
    out: dict[str, Any] = {}
    async with GatewayFleet(s) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        await streams(base, key, args.streams, 2.0, args.max_tokens)  # warm-up
        alone = await streams(base, key, args.streams, args.seconds, args.max_tokens)
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
            beside = await streams(base, key, args.streams, args.seconds, args.max_tokens)
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
    args = p.parse_args(argv)
    from bench.support.services import nats_server

    with tempfile.TemporaryDirectory() as d, nats_server(Path(d)) as url:
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
