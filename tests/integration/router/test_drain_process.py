"""`strait drain` on worker processes (FAKE engine, real nats-server): the drained worker takes
no new work, its running request moves to the other worker past `worker.drain_timeout_s`, and
the process exits cleanly."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.support.procs import ProcessFleet
from libs.client import StraitClient

pytestmark = pytest.mark.integration

FLEET = """
[gateway]
auth_enabled = false
[worker]
drain_timeout_s = 0.5
[fake_engine]
per_token_s = 0.02
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""
PREFIX = "drain.v1"


def test_strait_drain_moves_the_running_request_and_the_worker_exits(
    tmp_path: Path, nats_url: str
) -> None:
    env = {"STRAIT_NATS__SUBJECT_PREFIX": PREFIX}
    with ProcessFleet(tmp_path, nats_url, FLEET, env=env, workers=[{}, {}]) as fleet:
        time.sleep(1.0)  # beats: the router knows both workers

        async def scenario() -> tuple[int, int, str, str]:
            async with StraitClient(nats_url, prefix=PREFIX, report_usage=False) as client:
                async with client.generate(
                    "a long answer", max_tokens=150, ignore_eos=True, want_route=True
                ) as gen:
                    drained = ""
                    async for _ in gen:
                        if not drained:
                            assert gen.route is not None
                            drained = gen.route.worker_id
                            cmd = [sys.executable, "-m", "services.cli", "drain", drained]
                            done = await asyncio.to_thread(
                                subprocess.run,
                                cmd,
                                env=fleet.env_for({}),
                                capture_output=True,
                                text=True,
                            )
                            assert done.returncode == 0, done.stderr
                            assert "draining" in done.stdout
                assert gen.usage is not None and gen.finished is not None
                return gen.usage.completion_tokens, gen.migrations, gen.finished.worker_id, drained

        tokens, migrations, finished_on, drained = asyncio.run(scenario())
        assert tokens == 150 and migrations == 1 and finished_on != drained
        proc = fleet.procs[f"worker{drained.removeprefix('w')}"]
        assert proc.wait(timeout=15) == 0, fleet.logs(f"worker{drained.removeprefix('w')}")
