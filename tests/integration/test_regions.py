"""Two regions on this machine (docs/regions.md): two NATS clusters, "a" and "b", joined by a
gateway and started by the test; in each a router, two FAKE-engine workers and a gateway, as
separate processes; one SQLite ledger written by region a's gateway.

1. Both healthy: every request of either gateway runs in its own region (route events).
2. Region a's workers SIGKILLed while streams of a's gateway run: those streams continue in b
   (migration by replay) with the exact text; new requests of a's gateway are served by b
   within a few beat intervals; nothing fails.
3. Region a's whole NATS cluster stopped: b's clients see nothing (every request completes).
4. a's cluster and workers back: a's requests run in a again, and the ledger holds every
   request of both regions exactly once, with its token count.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from bench.chaos.fleet import ledger_rows
from bench.chaos.load import reference
from bench.support.regions import (
    Call,
    RegionFleet,
    Supercluster,
    chat,
    fake_config,
    route_events,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PER_TOKEN_S = 0.02
LONG = 150  # tokens of the streams running when a's workers die (3 s each)
SHORT = 20


def call(gateway: str, k: int, max_tokens: int = SHORT) -> Call:
    return Call(gateway, f"request {k} from {gateway}: tell me about the sea", k, max_tokens)


async def exact(c: Call) -> bool:
    return c.ok and c.text == await reference(c.prompt, c.seed, c.max_tokens)


async def test_two_regions_fail_over_and_lose_nothing(tmp_path: Path) -> None:
    sc = Supercluster(tmp_path / "nats", ["a", "b"])
    sc.start()
    config = fake_config(PER_TOKEN_S)
    calls: list[Call] = []
    try:
        with (
            RegionFleet(tmp_path / "a", sc, "a", config) as a,
            RegionFleet(tmp_path / "b", sc, "b", config) as b,
        ):
            a.wait_workers(4)
            b.wait_workers(4)
            async with httpx.AsyncClient(timeout=60) as http:
                # 1. Healthy: local.
                healthy = [call(g, k) for k in range(8) for g in ("a", "b")]
                await asyncio.gather(
                    *(chat(http, {"a": a, "b": b}[c.gateway].url, c) for c in healthy)
                )
                calls += healthy
                assert all([await exact(c) for c in healthy]), [c.error for c in healthy]

                # 2. a's workers die under running streams; new requests keep coming to a.
                running = [call("a", 100 + k, LONG) for k in range(6)]
                tasks = [asyncio.create_task(chat(http, a.url, c)) for c in running]
                await asyncio.sleep(1.0)
                assert all(c.texts for c in running), "the streams had not started"
                t_kill = time.perf_counter()
                a.kill_workers()
                after = [call("a", 200 + k) for k in range(8)]
                for c in after:  # one at a time: the first ones meet the failover
                    await chat(http, a.url, c)
                await asyncio.gather(*tasks)
                calls += running + after
                assert all([await exact(c) for c in running]), [(c.error, c.usage) for c in running]
                assert all([await exact(c) for c in after]), [(c.error, c.usage) for c in after]
                first_token_s = after[0].t_first - t_kill  # type: ignore[operator]
                assert first_token_s < 10.0, first_token_s

                # 3. a's whole cluster stops: b's clients see nothing.
                sc.stop_region("a")
                dark = [call("b", 300 + k) for k in range(8)]
                await asyncio.gather(*(chat(http, b.url, c) for c in dark))
                calls += dark
                assert all([await exact(c) for c in dark]), [c.error for c in dark]

                # 4. a returns, with its workers: its traffic returns to it.
                sc.restart_region("a")
                a.restart_workers()
                a.wait_workers(4)
                back = [call("a", 400 + k) for k in range(6)]
                await asyncio.gather(*(chat(http, a.url, c) for c in back))
                calls += back
                assert all([await exact(c) for c in back]), [c.error for c in back]

            # Where each request ran (the ledger's stream holds both regions' route events).
            ids = {c.request_id for c in calls}
            assert len(ids) == len(calls) and "" not in ids
            # b's events reach a's stream once a is back, when the server retries the source:
            # its back-off took 37.6 s in bench.chaos's region-nats and over 30 s here once.
            deadline = time.monotonic() + 90
            while True:
                routes = await route_events(sc.url("a"))
                unrouted = [(c.gateway, c.seed) for c in calls if c.request_id not in routes]
                if not unrouted or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert unrouted == []
            where = {c.request_id: routes[c.request_id].route for c in calls}
            for c in healthy + back:
                assert (where[c.request_id].region, where[c.request_id].cross_region) == (
                    c.gateway,
                    "",
                ), c.request_id
            for c in dark:
                assert where[c.request_id].region == "b"
            # The streams of a's dead workers went on in b, after a migration.
            for c in running:
                r = where[c.request_id]
                assert r.region == "b" and r.code == "migrated", r
            for c in after:
                assert where[c.request_id].region == "b", where[c.request_id]
            assert where[after[-1].request_id].cross_region == "no_local_worker"

            # The ledger: every request of both regions once, with its tokens.
            deadline = time.monotonic() + 60
            while True:
                rows = ledger_rows(tmp_path / "ledger.db")
                missing = [c.request_id for c in calls if c.request_id not in rows]
                if not missing or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert missing == []
            assert len(rows) == len(calls)
            assert all(rows[c.request_id][:2] == ("ok", c.max_tokens) for c in calls)
    finally:
        sc.stop()


async def test_streams_crossing_a_cut_link_pause_and_end_with_their_text(tmp_path: Path) -> None:
    """Region a has no worker: its gateway's requests run in b, across the gateway. The link is
    cut mid-stream for 8 s: a's router loses b's workers, its streams wait for a worker
    (``waiting_for_worker``) and continue in b when the link returns, with the exact text."""
    from bench.chaos.regions import LinkProxy
    from bench.support.services import free_port

    via = {r: free_port() for r in "ab"}
    sc = Supercluster(tmp_path / "nats", ["a", "b"], via=via)
    link = LinkProxy({via[r]: sc.gateway_port[r] for r in "ab"})
    link.start()
    sc.start()
    config = fake_config(PER_TOKEN_S)
    try:
        with (
            RegionFleet(tmp_path / "b", sc, "b", config) as b,
            RegionFleet(tmp_path / "a", sc, "a", config, workers=0) as a,
        ):
            a.wait_workers(2)
            async with httpx.AsyncClient(timeout=120) as http:
                crossing = [call("a", 500 + k, 300) for k in range(4)]  # 6 s each
                tasks = [asyncio.create_task(chat(http, a.url, c)) for c in crossing]
                await asyncio.sleep(1.5)
                link.cut()
                await asyncio.sleep(8.0)
                link.restore()
                await asyncio.gather(*tasks)
            assert all([await exact(c) for c in crossing]), [(c.error, c.usage) for c in crossing]
            routes = await route_events(sc.url("a"))
            for c in crossing:
                r = routes[c.request_id].route
                assert (r.region, r.code) == ("b", "migrated"), r
            assert b.live_workers() == 2
    finally:
        sc.stop()
        link.stop()
