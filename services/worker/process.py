"""One worker process's life, whatever its role: what every role's ``main.serve`` ends in.

Each role's entry (``services/worker/main.py`` for ``aggregated``, ``services/prefill/main.py``,
``services/decode/main.py``; ``strait worker`` picks by ``worker.role``) connects to NATS,
loads its backend (:func:`build_backend`, :func:`start_announced`), builds its ``Worker`` and
hands it to :func:`run_worker`, which serves ``work.<worker_id>``,
``cancel.>``, ``resend.>`` and ``admin.teams`` and beats until SIGTERM or a ``DrainRequest`` on
``admin.drain.<worker_id>`` (``strait drain``): both drain, then exit. Under `strait up`'s
planner a worker may also start as a warm standby (SIGUSR1 activates it) and be parked back
into one (SIGUSR2: drain, stop beating, wait for SIGUSR1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.backend import Backend
from libs.engine.async_engine import AsyncEngineBackend
from libs.log import fields
from libs.models.engine_backend import engine_backend
from libs.protocol import AssignmentAck, DrainRequest
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings
from services.endpoint import Endpoint, logs
from services.worker.base import Worker, default_worker_id
from services.worker.starting import Announcer

log = logging.getLogger("strait.worker")


def build_backend(settings: Settings) -> Backend:
    """The pool's backend: the real engine, or the FAKE one when it says ``backend = "fake"``."""
    pool = settings.pool(settings.worker.pool)
    if pool is None:
        raise SystemExit(f"worker.pool {settings.worker.pool!r} is not in settings.pools")
    if pool.backend == "fake":
        from libs.backend.fake import FakeBackend

        log.warning("using the FAKE backend (load tests only)", extra=fields(pool=pool.name))
        eng = settings.engine
        return FakeBackend(
            settings.fake_engine,
            model_name=pool.model,
            capacity=eng.max_num_seqs,
            headroom=eng.fair_headroom_seqs if eng.fair_share else 0,
            prompt_cost=eng.fair_prompt_token_cost,
        )
    return engine_backend(settings, pool)


async def start_announced(nc: NATS, settings: Settings, backend: Backend) -> None:
    """Start ``backend`` (load the model), announcing each stage meanwhile (``Announcer``;
    a standby says nothing until it has loaded: it is not coming to serve by itself)."""
    worker_id = settings.worker.worker_id or default_worker_id(settings.worker.pool)
    announcer = Announcer(nc, settings, worker_id, settings.worker.role)
    if isinstance(backend, AsyncEngineBackend):
        backend.on_stage = announcer.advance
    stop = asyncio.Event()
    task = None
    if not settings.worker.standby:
        task = asyncio.create_task(announcer.run(stop))
    try:
        await backend.start()
    finally:
        stop.set()
        if task is not None:
            await task


async def run_worker(
    ctx: ServiceContext,
    nc: NATS,
    worker: Worker,
    subs: list[Subscription],
    tasks: list[asyncio.Task[None]],
) -> None:
    """Serve the worker's endpoints (plus the role's own ``subs`` and ``tasks``) and beat
    until SIGTERM; then drain running requests and close. Every role's serve ends here.
    A standby worker (``worker.standby``) waits, loaded and connected, for SIGUSR1 first.
    SIGUSR2 parks a serving worker (the local actuator's scale-down while the pool role is
    short of standbys): it drains as for SIGTERM, stops beating, and is a standby again, its
    model loaded, until the next SIGUSR1."""
    waiting, subscribed = worker.settings.worker.standby, False
    try:
        while True:
            if waiting and not await standby(ctx, worker):
                return
            if not subscribed:
                subs += await _subscribe(ctx, nc, worker)
                subscribed = True
            worker.draining = False
            ctx.serving(lambda: nc.is_connected and not worker.draining)
            # Beats go on while draining (they say so, and keep the router from moving
            # requests that are finishing here); they stop once the drain is over.
            beats_stop = asyncio.Event()
            beats = asyncio.create_task(worker.beat_loop(beats_stop))
            log.info(
                "worker ready",
                extra=fields(
                    worker_id=worker.worker_id,
                    role=worker.role,
                    pool=worker.pool,
                    model=worker.backend.model_name,
                ),
            )
            try:
                parked = await stopped_or_parked(ctx)
                await worker.drain(worker.settings.worker.drain_timeout_s)
            finally:
                beats_stop.set()
                await asyncio.gather(beats, return_exceptions=True)
            if not parked:
                return
            # Parked: no beats, nothing routed here; a stray assignment is refused (draining).
            log.info("worker parked", extra=fields(worker_id=worker.worker_id, pool=worker.pool))
            waiting = True
    finally:
        for t in tasks:
            t.cancel()
        for s in subs:
            await s.unsubscribe()
        await worker.flush_usage(worker.settings.worker.usage_publish_timeout_s)
        await nc.drain()
        await worker.backend.stop()


async def _subscribe(ctx: ServiceContext, nc: NATS, worker: Worker) -> list[Subscription]:
    """The worker's endpoints and its ``admin.drain.<worker_id>`` (once: a parked worker keeps
    them, refusing work while it is parked)."""

    async def on_drain(d: DrainRequest, msg: Msg) -> AssignmentAck:
        log.info("drain requested", extra=fields(worker_id=d.worker_id, reason=d.reason))
        ctx.stopping.set()  # the SIGTERM path: drain, then exit (after this answer)
        return AssignmentAck(accepted=True, reason="draining")

    drain = Endpoint("worker.drain", DrainRequest, on_drain, logs(log, "bad drain request"))
    endpoints = [*worker.endpoints(), (worker.subjects.drain(worker.worker_id), drain)]
    return [await ep.subscribe(nc, subject) for subject, ep in endpoints]


# Set by SIGUSR1 (``arm_signals``): a standby worker may be told to serve while it still loads.
_ACTIVATED = threading.Event()
# Set by SIGUSR2: a serving worker is told to drain and go back to standby.
_PARKED = threading.Event()
# Seconds between a worker's looks at those flags.
STANDBY_POLL_S = 0.05


def _on_activate(_sig: int, _frame: object) -> None:
    _ACTIVATED.set()


def _on_park(_sig: int, _frame: object) -> None:
    # Handlers run one at a time on the main thread: a SIGUSR1 after this one re-activates.
    _ACTIVATED.clear()
    _PARKED.set()


def arm_signals(settings: Settings) -> None:
    """Before anything loads: SIGUSR1 (activate) and SIGUSR2 (park) only set flags (their
    default actions would end the process). `strait up` starts workers with both blocked, so
    one sent before this point is pending, and is delivered here, once the handlers are in
    place. Both pending: their order is lost (the kernel delivers by number), and serving
    wins: a worker the supervisor counts as parked may serve (a worker too many, which the
    planner sees and scales down), never the reverse (a worker short)."""
    signal.signal(signal.SIGUSR1, _on_activate)
    signal.signal(signal.SIGUSR2, _on_park)
    pending = signal.sigpending()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    if {signal.SIGUSR1, signal.SIGUSR2} <= pending:
        _PARKED.clear()
        _ACTIVATED.set()


async def stopped_or_parked(ctx: ServiceContext) -> bool:
    """Wait for SIGTERM (or a drain request: False) or SIGUSR2 (True)."""
    while not _PARKED.is_set():
        with contextlib.suppress(TimeoutError):  # the flag is set from a signal handler
            await asyncio.wait_for(ctx.stopping.wait(), STANDBY_POLL_S)
        if ctx.stopping.is_set():
            return False
    _PARKED.clear()
    return True


async def standby(ctx: ServiceContext, worker: Worker) -> bool:
    """Warm standby (docs/planner.md): the model is loaded and NATS connected, but the worker
    neither beats nor takes work, so nothing is routed to it. ``strait up``'s supervisor
    sends SIGUSR1 when the planner wants one more worker; True once activated, False when
    stopped first."""
    log.info("worker on standby", extra=fields(worker_id=worker.worker_id, pool=worker.pool))
    # It says so every beat interval: `strait up` activates only standbys that have loaded.
    announcer = Announcer(worker.nc, worker.settings, worker.worker_id, worker.role)
    announcer.advance("standby")
    stop = asyncio.Event()
    announcing = asyncio.create_task(announcer.run(stop))
    try:
        while not _ACTIVATED.is_set():
            with contextlib.suppress(TimeoutError):  # the flag is set from a signal handler
                await asyncio.wait_for(ctx.stopping.wait(), STANDBY_POLL_S)
            if ctx.stopping.is_set():
                return False
    finally:
        stop.set()
        await announcing
    log.info("worker activated", extra=fields(worker_id=worker.worker_id, pool=worker.pool))
    return True


def run_role(
    settings: Settings, name: str, serve: Callable[[ServiceContext], Awaitable[None]]
) -> int:
    """Run one role's ``serve`` as service ``name`` (the worker's metrics port), its
    standby and park signals armed before anything loads."""
    arm_signals(settings)
    return run_service(name, serve, settings, http_port=settings.worker.metrics_port)
