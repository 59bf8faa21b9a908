"""Regions on the real model (docs/regions.md): two NATS clusters "a" and "b" joined by a
gateway, one SmolLM2 worker in each; a greedy stream sent in region a is running on a's worker
when that worker is SIGKILLed, continues on b's worker (migration by replay, across the
gateway), and its text is ``model.generate``'s."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from bench.support.regions import RegionFleet, Supercluster, route_events
from libs.client import StraitClient
from tests.e2e.conftest import REAL_FLEET
from tests.e2e.test_migration import (
    KILL_AFTER_DELTAS,
    MAX_TOKENS,
    QUESTION,
    generate_reference,
    wait_worker_ready,
)

# Two real workers load the model (and, on a checkout's first run, build the CPU kernels).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_stream_whose_region_goes_dark_ends_in_the_other_with_the_same_text(
    tmp_path: Path, smollm2: Path
) -> None:
    expected = generate_reference(smollm2)
    # Eager: the answer is the same compiled or not, and two workers compiling on a busy
    # 2-core machine take minutes.
    env = {"STRAIT_MODELS__DIR": str(smollm2.parent.resolve()), "STRAIT_ENGINE__COMPILE": "false"}
    config = REAL_FLEET + 'mode = "aggregated"\n'
    sc = Supercluster(tmp_path / "nats", ["a", "b"])
    sc.start()
    try:
        with (
            RegionFleet(tmp_path / "a", sc, "a", config, 1, env=env, ready_timeout_s=300) as a,
            RegionFleet(tmp_path / "b", sc, "b", config, 1, env=env, ready_timeout_s=300) as b,
        ):
            wait_worker_ready(a.pf, "worker0", 600)
            wait_worker_ready(b.pf, "worker0", 600)
            a.wait_workers(2)

            async def scenario() -> tuple[str, int, int, str]:
                text, deltas = "", 0
                async with StraitClient(sc.url("a"), region="a", report_usage=False) as client:
                    async with client.generate(
                        messages=[{"role": "user", "content": QUESTION}],
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        want_route=True,
                        idle_timeout_s=60,
                    ) as gen:
                        async for d in gen:
                            text += d.text
                            deltas += 1
                            if deltas == KILL_AFTER_DELTAS:
                                assert gen.route is not None and gen.route.region == "a"
                                os.kill(a.pf.procs["worker0"].pid, signal.SIGKILL)
                    assert gen.usage is not None
                    return text, gen.usage.completion_tokens, gen.migrations, gen.request_id

            text, tokens, migrations, rid = asyncio.run(scenario())
            assert migrations == 1, "the request did not migrate"
            assert text == expected
            assert 0 < tokens <= MAX_TOKENS
            route = asyncio.run(route_events(sc.url("a")))[rid].route
            assert (route.region, route.cross_region, route.code) == (
                "b",
                "no_local_worker",
                "migrated",
            )
    finally:
        sc.stop()
