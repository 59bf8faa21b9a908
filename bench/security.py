"""What a secured fleet costs (docs/security.md): TLS and accounts on a request's path, and how
fast a revocation takes effect.

    .venv/bin/python -m bench.security --requests 200

In this process: a router and one FAKE worker (``per_token_s`` 0: no model) first on a plain
JetStream nats-server, then on a secured one (accounts from ``strait teams``, TLS from the dev
CA; bench/support/secure.py); a ``StraitClient`` sends ``--requests`` requests of 16 tokens one
after another (10 warm-up first) and prints their latency p50 / p99 — as the fleet (embedded) and
as a team (secured). Then it does what ``strait teams add`` does for a new team on the running
server (its requests stream, the staged and the full reload, each confirmed) and prints how long
that took and the new team's first request. Last, with one 400-token request of the team
streaming (50 ms a token), it does what ``strait teams revoke`` does and prints how long the
config rewrite and server reload took, when the worker had dropped the request, and when the
team's connection was closed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.support.fleet import running_fleet
from bench.support.secure import secure_nats
from bench.support.services import isolated_settings, nats_binary, nats_server
from libs.client import StraitClient
from libs.settings import Settings

TOKENS = 16
WARMUP = 10
REVOKE_PER_TOKEN_S = 0.05


def fake_fleet(s: Settings) -> Settings:
    s.pools[0].model, s.pools[0].backend = "fake-model", "fake"
    s.fake_engine.per_token_s = 0.0
    s.worker.beat_interval_s = 0.1
    s.teams.reload_interval_s = 0.1
    return s


async def latency_ms(client: StraitClient, n: int) -> tuple[float, float]:
    for _ in range(WARMUP):
        await client.complete("warm up", max_tokens=TOKENS)
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        await client.complete("hello", max_tokens=TOKENS)
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return statistics.median(took), took[min(len(took) - 1, int(0.99 * len(took)))]


async def until(check: Callable[[], bool], step: float = 0.002, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / step)):
        if check():
            return
        await asyncio.sleep(step)
    raise TimeoutError("not within the limit")


async def run(n: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="strait-bench-security-"))
    with nats_server(tmp / "plain") as url:
        s = fake_fleet(isolated_settings(tmp / "embedded", url))
        async with running_fleet(s), StraitClient.from_settings(s, report_usage=False) as c:
            p50, p99 = await latency_ms(c, n)
    print(f"embedded, as the fleet:   {TOKENS}-token request p50 {p50:.2f} ms  p99 {p99:.2f} ms")
    s = fake_fleet(isolated_settings(tmp / "secured", ""))
    async with secure_nats(s, {"bench": None}) as sf, running_fleet(s) as fleet:
        n_ = s.nats
        team = StraitClient(
            n_.url,
            prefix=n_.subject_prefix,
            nkey_seed_file=str(sf.store.seed_file("bench")),
            tls_ca_file=n_.tls_ca_file,
        )
        binary = nats_binary()
        assert binary is not None
        async with team as c:
            p50, p99 = await latency_ms(c, n)
            print(
                f"secured, as a team (TLS): {TOKENS}-token request p50 {p50:.2f} ms  "
                f"p99 {p99:.2f} ms"
            )
            t0 = time.perf_counter()
            sf.store.add("late")
            await sf.ensure_streams(["late"])
            await asyncio.to_thread(sf.apply, binary)
            await sf.announce([])
            added = time.perf_counter()
            late = StraitClient(
                n_.url,
                prefix=n_.subject_prefix,
                nkey_seed_file=str(sf.store.seed_file("late")),
                tls_ca_file=n_.tls_ca_file,
                publish_attempts=1,
            )
            async with late:
                await late.complete("first", max_tokens=TOKENS)
            print(
                f"add a team to the running server: stream + staged and full reload "
                f"{1000 * (added - t0):.0f} ms; its first request (connect included) done "
                f"{1000 * (time.perf_counter() - added):.0f} ms later"
            )
            worker = fleet.workers[0]
            worker.backend.settings.per_token_s = REVOKE_PER_TOKEN_S  # type: ignore[attr-defined]
            gen = c.generate("a long answer", max_tokens=400)
            async with gen:
                await anext(aiter(gen))
                t0 = time.perf_counter()
                sf.store.revoke("bench")
                await asyncio.to_thread(sf.apply, binary)
                reloaded = time.perf_counter()
                await sf.announce(["bench"])
                await until(lambda: not worker.worker.tasks)
                cancelled = time.perf_counter()
                await until(lambda: not c.nc.is_connected)
                closed = time.perf_counter()
    print(
        f"revoke: config + reload {1000 * (reloaded - t0):.0f} ms; the running request "
        f"dropped by its worker after {1000 * (cancelled - t0):.0f} ms; the team's connection "
        f"closed after {1000 * (closed - t0):.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args(argv)
    # The revoked team's client keeps trying to reconnect, and nats-py logs each refusal.
    logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)
    asyncio.run(run(args.requests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
