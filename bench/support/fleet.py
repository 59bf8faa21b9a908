"""Fleet pieces run inside the caller's event loop (a test's or a bench's): router, workers (any
backend), gateway.

``async with InProcessFleet(settings) as fleet:`` starts a router; ``await fleet.add_worker(...)``
starts a worker on a backend and returns a handle whose ``stop()`` ends it (to simulate a worker
dying: ``kill()`` stops its beats and subscriptions without draining). ``await fleet.gateway()``
serves the HTTP app with uvicorn on a free port and returns its base URL. ``GatewayFleet`` is the
same fleet stopping within seconds; ``running_fleet`` adds FAKE workers and stops fast too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from bench.support.services import free_port, wait_port
from libs.backend import Backend
from libs.backend.fake import FakeBackend
from libs.runtime import ServiceContext
from libs.settings import Settings
from libs.wire.nats_util import connect, provision
from services.decode.worker import DecodeWorker
from services.gateway.app import create_app
from services.router.main import serve as router_serve
from services.router.router import Router
from services.worker.aggregated import AggregatedWorker
from services.worker.base import Worker


@dataclass
class WorkerHandle:
    worker: Worker
    backend: Backend
    nc: Any
    subs: list[Any]
    beats: asyncio.Task[None]
    stopping: asyncio.Event

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    async def kill(self) -> None:
        """Vanish without a word: no more beats, no replies, tasks dropped."""
        self.beats.cancel()
        for t in list(self.worker.tasks.values()):
            t.cancel()
        await self.nc.close()

    async def stop(self) -> None:
        self.stopping.set()
        await self.worker.drain(5.0)
        self.beats.cancel()
        if not self.nc.is_closed:
            await self.nc.drain()


@dataclass
class InProcessFleet:
    settings: Settings
    router: bool = True
    workers: list[WorkerHandle] = field(default_factory=list)
    # The Router of each router replica started here (its registry, watch, decisions).
    routers: list[Router] = field(default_factory=list)
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _ctxs: list[ServiceContext] = field(default_factory=list)
    _servers: list[uvicorn.Server] = field(default_factory=list)
    # The FastAPI app of each gateway started here (its state: fleet, stores, batch runner).
    apps: list[Any] = field(default_factory=list)
    # A secured fleet's team client (bench/support/secure.py): nats-py connect options and
    # the team's seed file; empty on the embedded server.
    client_options: dict[str, Any] = field(default_factory=dict)
    team_seed_file: str = ""

    async def __aenter__(self) -> InProcessFleet:
        if self.router:
            await self.add_router()
        return self

    async def add_router(self) -> None:
        ctx = ServiceContext(name="router", settings=self.settings)
        self._ctxs.append(ctx)
        self._tasks.append(asyncio.create_task(router_serve(ctx, on_router=self.routers.append)))

    async def add_worker(
        self,
        worker_id: str,
        pool: str = "default",
        backend: Backend | None = None,
        model: str = "fake-model",
        role: str = "aggregated",
        cache: Any = None,
    ) -> WorkerHandle:
        """A worker of ``role``: ``aggregated``, or ``prefill``/``decode`` of a disaggregated
        pool (both need an AsyncEngineBackend; ``cache`` is the prefill's CacheClient)."""
        s = self.settings.model_copy(deep=True)
        s.worker.pool = pool
        s.worker.worker_id = worker_id
        s.worker.role = role  # type: ignore[assignment]
        backend = backend or FakeBackend(s.fake_engine, model_name=model)
        await backend.start()
        nc = await connect(s.nats, f"worker-{worker_id}")
        w: Worker
        if role == "prefill":
            from services.prefill.worker import PrefillWorker

            w = PrefillWorker(nc, s, backend, cache)  # type: ignore[arg-type]
        elif role == "decode":
            w = DecodeWorker(nc, s, backend)
        else:
            w = AggregatedWorker(nc, s, backend)
        subs = [await ep.subscribe(nc, subject) for subject, ep in w.endpoints()]
        stopping = asyncio.Event()
        beats = asyncio.create_task(w.beat_loop(stopping))
        if isinstance(w, DecodeWorker):
            from services.decode.handoff import HandoffReceiver

            receiver = HandoffReceiver(w, backend)  # type: ignore[arg-type]
            subs += await receiver.subscribe()
            self._tasks.append(asyncio.create_task(receiver.sweep_loop(stopping)))
        h = WorkerHandle(w, backend, nc, subs, beats, stopping)
        self.workers.append(h)
        return h

    async def gateway(self, **create_kwargs: Any) -> str:
        port = free_port()
        s = self.settings.model_copy(deep=True)
        s.gateway.port = port
        app = create_app(s, **create_kwargs)
        self.apps.append(app)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
        )
        self._servers.append(server)
        self._tasks.append(asyncio.create_task(server.serve()))
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(wait_port, port), "gateway did not start"
        return f"http://127.0.0.1:{port}"

    async def wait_workers(self, n: int, timeout: float = 5.0) -> None:
        """Wait until the worker beats have been seen (give the router a beat interval)."""
        await asyncio.sleep(self.settings.worker.beat_interval_s * 2)

    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.should_exit = True
        for w in self.workers:
            with contextlib.suppress(Exception):
                if not w.nc.is_closed:
                    await w.stop()
        for ctx in self._ctxs:
            ctx.stopping.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        for t in self._tasks:
            t.cancel()


# Seconds a GatewayFleet gets to stop before its tasks are cancelled. NOTE: the router's final
# nc.drain() waits on its pull subscription forever (nats-py), which would cost every test the
# full 10 s of InProcessFleet's own teardown.
STOP_GRACE_S = 1.0


class GatewayFleet(InProcessFleet):
    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.should_exit = True
        for w in self.workers:
            try:
                if not w.nc.is_closed:
                    await asyncio.wait_for(w.stop(), STOP_GRACE_S * 2)
            except Exception:
                pass
        for ctx in self._ctxs:
            ctx.stopping.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)


@asynccontextmanager
async def running_fleet(
    settings: Settings, workers: int = 1, router: bool = True, capacity: int = 64
) -> AsyncIterator[InProcessFleet]:
    """A router (optional) and ``workers`` FAKE workers ``w1``… in pool ``default``, stopping
    fast (the client tests and bench.security)."""
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
            # queue until InProcessFleet's 10 s limit (a fetch in flight at shutdown). These
            # callers do not test router shutdown: give it a second, then cancel.
            for ctx in f._ctxs:
                ctx.stopping.set()
            if f._tasks:
                await asyncio.wait(f._tasks, timeout=1.0)
            for t in f._tasks:
                t.cancel()
