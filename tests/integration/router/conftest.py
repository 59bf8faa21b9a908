"""Router fleet tests: fast beats, short TTLs, helpers to send requests and read decisions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from libs.protocol import (
    GenerateRequest,
    RouteDecision,
    StreamMessage,
    Subjects,
    encode,
)
from libs.settings import PoolSettings, Settings
from libs.wire.stream_reader import StreamReader

SMALL, LARGE = "smollm2-135m-instruct", "gemma3-270m"


@pytest.fixture
def router_settings(settings: Settings) -> Settings:
    settings.pools[0].model = "fake-model"
    settings.pools[0].backend = "fake"
    settings.worker.beat_interval_s = 0.05
    settings.fleet.worker_ttl_s = 0.4
    settings.router.sweep_interval_s = 0.05
    settings.router.assign_timeout_s = 1.0
    settings.fake_engine.per_token_s = 0.002
    return settings


@pytest.fixture
def two_pool_settings(router_settings: Settings) -> Settings:
    """configs/two-pools.toml's shape on the fake backend."""
    router_settings.pools = [
        PoolSettings(name="small", model=SMALL, backend="fake"),
        PoolSettings(name="large", model=LARGE, backend="fake"),
    ]
    return router_settings


async def poll(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> float:
    """Wait until ``pred()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@dataclass
class Client:
    nc: Any
    js: Any
    subjects: Subjects
    decisions: list[RouteDecision]

    async def run(self, req: GenerateRequest, timeout: float = 10.0) -> list[StreamMessage]:
        """Publish ``req`` like the gateway does and read its stream to the end."""
        async with StreamReader(
            self.nc, self.subjects.stream(req.request_id), timeout, timeout
        ) as reader:
            await self.js.publish(self.subjects.requests, encode(req))
            return [m async for m in reader.messages()]

    def decision(self, request_id: str) -> list[RouteDecision]:
        return [d for d in self.decisions if d.request_id == request_id]


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[Client]:
    import nats

    from libs.wire.nats_util import provision

    nc = await nats.connect(settings.nats.url)
    js = nc.jetstream()
    await provision(js, settings.nats)
    subjects = Subjects(settings.nats.subject_prefix)
    c = Client(nc, js, subjects, [])

    async def on_decision(msg: Any) -> None:
        c.decisions.append(msgspec.json.decode(msg.data, type=RouteDecision))

    await nc.subscribe(subjects.event("route"), cb=on_decision)
    try:
        yield c
    finally:
        await nc.drain()
