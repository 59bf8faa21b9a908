"""A FAKE fleet for the client tests that shuts down fast."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from libs.fake_engine import FakeBackend
from libs.nats_util import connect, provision
from libs.settings import Settings
from tests.support.fleet import InProcessFleet


@asynccontextmanager
async def running_fleet(
    settings: Settings, workers: int = 1, router: bool = True, capacity: int = 64
) -> AsyncIterator[InProcessFleet]:
    """A router (optional) and ``workers`` FAKE workers ``w1``… in pool ``default``."""
    async with InProcessFleet(settings, router=router) as f:
        # The streams exist before the test publishes (the router provisions them too, later).
        nc = await connect(settings.nats, "test-provision")
        await provision(nc.jetstream(), settings.nats)
        await nc.drain()
        for i in range(1, workers + 1):
            backend = FakeBackend(
                settings.fake_engine.model_copy(), "fake-model", capacity=capacity
            )
            await f.add_worker(f"w{i}", backend=backend)
        if workers:
            await f.wait_workers(workers)
        try:
            yield f
        finally:
            # NOTE: the router's final `nc.drain()` sometimes waits on its pull subscription's
            # queue until InProcessFleet's 10 s limit (a fetch in flight at shutdown). These tests
            # do not test router shutdown: give it a second, then cancel, to keep the suite fast.
            for ctx in f._ctxs:
                ctx.stopping.set()
            if f._tasks:
                await asyncio.wait(f._tasks, timeout=1.0)
            for t in f._tasks:
                t.cancel()
