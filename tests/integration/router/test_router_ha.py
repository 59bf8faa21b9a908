"""Two routers side by side (processes, FAKE workers, real nats-server): one is killed with
SIGKILL under load, and every request still completes once, with its whole answer."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from bench.support.procs import ProcessFleet
from libs.client import StraitClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLEET = """
[gateway]
auth_enabled = false
[fake_engine]
per_token_s = 0.01
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""
PREFIX = "ha.v1"
STREAMS = 40
MAX_TOKENS = 60


def test_a_router_killed_under_load_loses_no_request(tmp_path: Path, nats_url: str) -> None:
    env = {"STRAIT_NATS__SUBJECT_PREFIX": PREFIX}
    with ProcessFleet(
        tmp_path,
        nats_url,
        FLEET,
        env=env,
        workers=[{}, {}],
        extra_services=[("router2", "router", {})],
    ) as fleet:
        time.sleep(1.0)

        async def scenario() -> list[tuple[int, str]]:
            async with StraitClient(
                nats_url, prefix=PREFIX, report_usage=False, idle_timeout_s=30
            ) as client:

                async def one(i: int) -> tuple[int, str]:
                    await asyncio.sleep(i * 0.05)  # arrivals spread over the kill
                    c = await client.complete(
                        f"request {i}", max_tokens=MAX_TOKENS, ignore_eos=True
                    )
                    return c.usage.completion_tokens, c.finished.worker_id

                async def kill() -> None:
                    await asyncio.sleep(0.8)
                    fleet.procs["router"].send_signal(signal.SIGKILL)

                results = await asyncio.gather(*(one(i) for i in range(STREAMS)), kill())
                return results[:STREAMS]  # type: ignore[return-value]

        t0 = time.monotonic()
        results = asyncio.run(scenario())
        assert fleet.procs["router"].poll() is not None  # it was killed under load
        assert [n for n, _ in results] == [MAX_TOKENS] * STREAMS
        # The requests the dead router had pulled come back after JetStream's ack wait.
        assert time.monotonic() - t0 < 60
