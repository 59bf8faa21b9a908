"""What ``/v1/responses`` costs over ``/v1/chat/completions`` in the gateway: the same short
requests on a FAKE worker (``fake_engine.per_token_s = 0``), one at a time, through the
official SDK; p50 latency of each, whole and streamed (alternating, after a warm-up).

Run: ``python -m bench.responses_overhead [--requests N]`` (starts its own nats-server and an
in-process fleet; SQLite under a temporary directory, responses stored as by default).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path


async def measure(n: int, tmp: Path, nats_url: str) -> dict[str, float]:
    from openai import AsyncOpenAI

    from bench.support.fleet import GatewayFleet
    from bench.support.services import isolated_settings
    from libs.db.keys import ensure_dev_key

    s = isolated_settings(tmp, nats_url)
    s.pools[0].model, s.pools[0].backend = "fake-model", "fake"
    s.fake_engine.per_token_s = 0.0
    s.fake_engine.per_prompt_token_s = 0.0
    s.gateway.response_cache_enabled = False
    key = await ensure_dev_key(s)
    times: dict[str, list[float]] = {"chat": [], "responses": [], "chat stream": [],
                                     "responses stream": []}  # fmt: skip
    async with GatewayFleet(s) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as c:
            msgs = [{"role": "user", "content": "tell me about rivers"}]

            async def chat(stream: bool) -> None:
                if stream:
                    async for _ in await c.chat.completions.create(
                        model="auto",
                        messages=msgs,
                        max_tokens=16,
                        stream=True,  # type: ignore[arg-type]
                    ):
                        pass
                else:
                    await c.chat.completions.create(model="auto", messages=msgs, max_tokens=16)  # type: ignore[arg-type]

            async def resp(stream: bool) -> None:
                if stream:
                    async for _ in await c.responses.create(
                        model="auto", input=msgs[0]["content"], max_output_tokens=16, stream=True
                    ):
                        pass
                else:
                    await c.responses.create(
                        model="auto", input=msgs[0]["content"], max_output_tokens=16
                    )

            for i in range(n + 10):
                for name, fn, stream in (
                    ("chat", chat, False),
                    ("responses", resp, False),
                    ("chat stream", chat, True),
                    ("responses stream", resp, True),
                ):
                    t = time.perf_counter()
                    await fn(stream)
                    if i >= 10:
                        times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.responses_overhead", description=__doc__)
    p.add_argument("--requests", type=int, default=100)
    args = p.parse_args(argv)
    from bench.support.services import nats_server

    with tempfile.TemporaryDirectory() as d, nats_server(Path(d)) as url:
        p50 = asyncio.run(measure(args.requests, Path(d), url))
    print("| 16 tokens, FAKE worker, one at a time | p50 ms |\n| --- | --- |")
    for k, v in p50.items():
        print(f"| {k} | {v:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
