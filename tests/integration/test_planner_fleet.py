"""The planner on processes: `strait up` (FAKE engine workers, a real nats-server of the
test's own) with `planner.enabled` and the local actuator. A load wave past one worker's
capacity makes the planner publish a scale-up and the supervisor start workers; when the wave
ends the planner scales down and the supervisor drains the surplus workers while requests are
still running on them: every request completes with all its tokens.

Deterministic under load: a wave runs until what it waits for has happened (a second worker
beats, a worker drains; bounded by ``WAIT_BOUND_S``), not for a fixed time a cold start may
outlast, and a standby is used only once it has said it has loaded (``WorkerStarting``
"standby"), as the supervisor does."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.support.services import free_port, unique_prefix
from libs.client import StraitClient
from libs.protocol import PlanDecision, Subjects, WorkerBeat, WorkerStarting

pytestmark = pytest.mark.integration

# One FAKE worker runs 4 requests at once (engine.max_num_seqs), each 40 tokens x 25 ms = 1 s:
# 4 requests a second. The wave sends 8 a second, the tail 1 a second of 2 s requests.
FLEET = """
[gateway]
auth_enabled = false
[router]
metrics_port = 0
[worker]
drain_timeout_s = 20.0
[engine]
max_num_seqs = 4
[fake_engine]
per_token_s = 0.025
per_prompt_token_s = 0.0
[planner]
enabled = true
metrics_port = 0
interval_s = 0.5
bucket_s = 1.0
horizon_s = 4.0
min_history_buckets = 3
scale_up_cooldown_s = 1.0
scale_down_cooldown_s = 2.0
scale_down_stable_s = 3.0
min_samples = 5
[planner.default]
min_replicas = 1
max_replicas = 3
ttft_slo_s = 1.0
itl_slo_s = 0.1
prior_service_s = 1.0
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
workers = 1
"""
WAVE_RPS, WAVE_S, WAVE_TOKENS = 8.0, 8.0, 40
TAIL_RPS, TAIL_S, TAIL_TOKENS = 1.0, 14.0, 80


# Seconds from the scale-up decision to the activated standby's first beat (beats every 0.2 s).
STANDBY_BEAT_BOUND_S = 1.5
# The longest a wave goes on for what it waits for, or the test waits for a standby to load
# (a cold FAKE worker beats ~4-6 s after its start on 2 idle cores, far later on a loaded one).
WAIT_BOUND_S = 90.0


async def send_wave(
    client: StraitClient,
    rps: float,
    seconds: float,
    tokens: int,
    until: Callable[[], bool] = lambda: True,
) -> list[int]:
    """Requests at ``rps`` for ``seconds`` and then until ``until()`` (at most
    ``WAIT_BOUND_S``), each read to its end; their completion tokens."""

    async def one(i: int) -> int:
        c = await client.complete(f"wave {i} {rps}", max_tokens=tokens, ignore_eos=True)
        return c.usage.completion_tokens

    tasks = []
    start = time.monotonic()
    while time.monotonic() - start < seconds or (
        not until() and time.monotonic() - start < WAIT_BOUND_S
    ):
        tasks.append(asyncio.create_task(one(len(tasks))))
        await asyncio.sleep(1 / rps)
    return list(await asyncio.gather(*tasks))


async def standby_loaded(nc: Any, prefix: str, worker_id: str) -> None:
    """Wait (at most ``WAIT_BOUND_S``) until ``worker_id`` says it is a loaded standby."""
    heard = asyncio.Event()

    async def on_starting(msg: Any) -> None:
        ann = msgspec.json.decode(msg.data, type=WorkerStarting)
        if ann.worker_id == worker_id and ann.stage == "standby":
            heard.set()

    sub = await nc.subscribe(Subjects(prefix).starting_all, cb=on_starting)
    try:
        await asyncio.wait_for(heard.wait(), WAIT_BOUND_S)
    finally:
        await sub.unsubscribe()


@contextmanager
def strait_up(tmp_path: Path, nats_url: str, config: str) -> Iterator[tuple[str, Path]]:
    """`strait up` on ``config`` against the test's nats-server, subjects of its own; yields
    (subject prefix, its log) once the fleet is ready, and stops it with SIGINT."""
    prefix = unique_prefix()
    tag = prefix.split(".")[0].upper()
    (tmp_path / "strait.toml").write_text(config)
    env = dict(os.environ)
    env.update(
        STRAIT_CONFIG=str(tmp_path / "strait.toml"),
        NATS_URL=nats_url,
        STRAIT_NATS__SUBJECT_PREFIX=prefix,
        STRAIT_NATS__REQUESTS_STREAM=f"{tag}_REQUESTS",
        STRAIT_NATS__EVENTS_STREAM=f"{tag}_EVENTS",
        STRAIT_NATS__KV_EVENTS_STREAM=f"{tag}_KV",
        STRAIT_STATE_DIR=str(tmp_path / "state"),
        STRAIT_GATEWAY__PORT=str(free_port()),
        STRAIT_TELEMETRY__LOG_JSON="false",
        # No well-known port (a `make run` fleet beside the tests holds them).
        STRAIT_SUPERVISOR__WORKER_METRICS_BASE_PORT="0",
        STRAIT_SUPERVISOR__METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    env.pop("DATABASE_URL", None)
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up"], env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 90
        while "fleet ready" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        yield prefix, log
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=40)
        except subprocess.TimeoutExpired:
            up.kill()


def test_planner_scales_up_under_a_wave_and_drains_down_dropping_nothing(
    tmp_path: Path, nats_url: str
) -> None:
    with strait_up(tmp_path, nats_url, FLEET) as (prefix, log):
        plans, workers, draining = asyncio.run(scenario(nats_url, prefix))
    text = log.read_text()
    ups = [p for p in plans if p.reason == "scale_up"]
    downs = [p for p in plans if p.reason == "scale_down"]
    assert ups and max(p.replicas for p in ups) >= 2, text[-4000:]
    assert len(workers) >= 2, (workers, text[-4000:])  # the supervisor started workers
    assert downs and draining, text[-4000:]  # and drained one on the planner's word
    assert "planner: draining" in text and "drained and exited (0)" in text, text[-4000:]


def test_warm_standby_serves_within_a_beat_of_the_decision(tmp_path: Path, nats_url: str) -> None:
    """With `planner.warm_standby = 1` the second worker is loaded before the wave: the
    scale-up activates it (SIGUSR1) instead of starting a process, and a new standby takes
    its place."""
    config = FLEET.replace(
        "[planner]\n", "[planner]\nwarm_standby = 1\nstandby_refill_s = 1.0\n"
    ).replace("max_replicas = 3", "max_replicas = 2")
    with strait_up(tmp_path, nats_url, config) as (prefix, log):
        first_beat, first_up = asyncio.run(standby_scenario(nats_url, prefix))
    text = log.read_text()
    assert "activated aggregated default-w1 from warm standby" in text, text[-4000:]
    assert "planner: started aggregated default-w2 (standby)" in text, text[-4000:]
    assert first_up is not None and "default-w1" in first_beat, (first_beat, text[-4000:])
    # A cold FAKE worker beats ~4-6 s after its start on 2 cores; an activated one at once.
    assert first_beat["default-w1"] - first_up < STANDBY_BEAT_BOUND_S, (first_beat, first_up)


def test_a_scale_down_parks_the_worker_and_the_next_wave_activates_it(
    tmp_path: Path, nats_url: str
) -> None:
    """With the pool role short of its standby (the replacement held back by a long refill
    delay), the scale-down after the wave parks one of the two serving workers (SIGUSR2: it
    drains and waits, loaded) instead of ending it, while the tail's requests run on it; the
    next wave activates it again with a signal and no process starts. Every request is whole."""
    config = FLEET.replace(
        "[planner]\n", "[planner]\nwarm_standby = 1\nstandby_refill_s = 600.0\n"
    ).replace("max_replicas = 3", "max_replicas = 2")
    with strait_up(tmp_path, nats_url, config) as (prefix, log):
        parked = asyncio.run(park_scenario(nats_url, prefix, log))
    text = log.read_text()
    # Either serving worker may be the one parked (the supervisor picks the surplus).
    assert parked in ("default-w0", "default-w1"), text[-4000:]
    activations = re.findall(r"activated aggregated (default-w\d) from warm standby", text)
    assert activations == ["default-w1", parked], text[-4000:]
    assert "default-w2" not in text, text[-4000:]  # no process started for either wave


async def park_scenario(nats_url: str, prefix: str, log: Path) -> str:
    """The waves and the tail; returns the worker the planner parked."""
    import nats

    nc = await nats.connect(nats_url)

    def parked_id() -> str | None:
        found = re.search(r"planner: parking aggregated (default-w\d)", log.read_text())
        return found[1] if found else None

    def parked() -> bool:
        return parked_id() is not None

    try:
        await standby_loaded(nc, prefix, "default-w1")
        async with StraitClient(nats_url, prefix=prefix, report_usage=False) as client:
            wave = await send_wave(client, WAVE_RPS, WAVE_S, WAVE_TOKENS)
            assert wave == [WAVE_TOKENS] * len(wave)
            # The tail keeps requests running on the activated worker while the planner parks
            # it, until it does.
            tail = await send_wave(client, TAIL_RPS, TAIL_S, TAIL_TOKENS, until=parked)
            assert tail == [TAIL_TOKENS] * len(tail)
            assert parked(), "no park within the tail"
            # Its drain over, it says it is a loaded standby again (every beat interval).
            parked_worker = parked_id()
            assert parked_worker is not None
            await standby_loaded(nc, prefix, parked_worker)
            again = await send_wave(client, WAVE_RPS, WAVE_S, WAVE_TOKENS)
            assert again == [WAVE_TOKENS] * len(again)
    finally:
        await nc.drain()
    return parked_worker


async def scenario(nats_url: str, prefix: str) -> tuple[list[PlanDecision], set[str], set[str]]:
    import nats

    subjects = Subjects(prefix)
    plans: list[PlanDecision] = []
    workers: set[str] = set()
    draining: set[str] = set()
    nc = await nats.connect(nats_url)

    async def on_plan(msg: object) -> None:
        plans.append(msgspec.json.decode(msg.data, type=PlanDecision))  # type: ignore[attr-defined]

    async def on_beat(msg: object) -> None:
        b = msgspec.json.decode(msg.data, type=WorkerBeat)  # type: ignore[attr-defined]
        workers.add(b.worker_id)
        if b.draining:
            draining.add(b.worker_id)

    await nc.subscribe(subjects.plans_all, cb=on_plan)
    await nc.subscribe(subjects.beats_all, cb=on_beat)
    try:
        async with StraitClient(nats_url, prefix=prefix, report_usage=False) as client:
            # The wave lasts until a started worker beats (a cold start under load may take
            # longer than the wave's 8 s).
            wave = await send_wave(
                client, WAVE_RPS, WAVE_S, WAVE_TOKENS, until=lambda: len(workers) >= 2
            )
            assert wave == [WAVE_TOKENS] * len(wave)  # every request of the wave, whole
            assert len(workers) >= 2, plans[-3:]
            # The tail keeps requests running on every worker while the planner drains.
            tail = await send_wave(
                client, TAIL_RPS, TAIL_S, TAIL_TOKENS, until=lambda: bool(draining)
            )
            assert tail == [TAIL_TOKENS] * len(tail)  # nothing dropped by the drains
    finally:
        await nc.drain()
    return plans, workers, draining


async def standby_scenario(nats_url: str, prefix: str) -> tuple[dict[str, float], float | None]:
    """A wave; returns each worker's first beat and the first scale-up decision (monotonic)."""
    import nats

    subjects = Subjects(prefix)
    first_beat: dict[str, float] = {}
    first_up: list[float] = []
    nc = await nats.connect(nats_url)

    async def on_plan(msg: object) -> None:
        d = msgspec.json.decode(msg.data, type=PlanDecision)  # type: ignore[attr-defined]
        if d.reason == "scale_up" and not first_up:
            first_up.append(time.monotonic())

    async def on_beat(msg: object) -> None:
        b = msgspec.json.decode(msg.data, type=WorkerBeat)  # type: ignore[attr-defined]
        first_beat.setdefault(b.worker_id, time.monotonic())

    await nc.subscribe(subjects.plans_all, cb=on_plan)
    await nc.subscribe(subjects.beats_all, cb=on_beat)
    try:
        await standby_loaded(nc, prefix, "default-w1")  # loaded before the wave, as meant
        async with StraitClient(nats_url, prefix=prefix, report_usage=False) as client:
            wave = await send_wave(client, WAVE_RPS, WAVE_S, WAVE_TOKENS)
            assert wave == [WAVE_TOKENS] * len(wave)
    finally:
        await nc.drain()
    return first_beat, first_up[0] if first_up else None
