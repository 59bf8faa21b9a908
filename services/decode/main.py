"""``strait decode``: a worker process (role ``aggregated`` by default: prefill + decode; role
``decode`` in a disaggregated pool, where requests arrive as KV handoffs from prefill workers).

Connects to NATS, loads its backend (the real engine, or the FAKE one when the pool says
``backend = "fake"``), then serves ``work.<worker_id>`` and ``cancel.>`` and beats until SIGTERM
or a ``DrainRequest`` on ``admin.drain.<worker_id>`` (``strait drain``): both drain, then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.backend import Backend
from libs.engine.async_engine import AsyncEngineBackend
from libs.log import fields
from libs.models.engine_backend import engine_backend
from libs.nats_util import connect
from libs.protocol import AssignmentAck, DrainRequest, ProtocolError, decode, encode
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.decode.handoff import HandoffReceiver
from services.decode.worker import Worker

log = logging.getLogger("strait.worker")


def build_backend(settings: Settings) -> Backend:
    pool = settings.pool(settings.worker.pool)
    if pool is None:
        raise SystemExit(f"worker.pool {settings.worker.pool!r} is not in settings.pools")
    if pool.backend == "fake":
        from libs.fake_engine import FakeBackend

        log.warning("using the FAKE backend (load tests only)", extra=fields(pool=pool.name))
        return FakeBackend(
            settings.fake_engine, model_name=pool.model, capacity=settings.engine.max_num_seqs
        )
    return engine_backend(settings, pool)


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    backend = build_backend(settings)
    await backend.start()
    nc = await connect(settings.nats, f"worker-{settings.worker.pool}")
    worker = Worker(nc, settings, backend)
    subs: list[Subscription] = []
    tasks: list[asyncio.Task[None]] = []
    if worker.role == "decode":  # disaggregated: requests arrive as KV handoffs
        if not isinstance(backend, AsyncEngineBackend):
            raise SystemExit("worker.role = 'decode' needs backend = 'engine' (KV handoff)")
        receiver = HandoffReceiver(worker, backend)
        subs += await receiver.subscribe()
        tasks.append(asyncio.create_task(receiver.sweep_loop(ctx.stopping)))
    await run_worker(ctx, nc, worker, subs, tasks)


async def run_worker(
    ctx: ServiceContext,
    nc: NATS,
    worker: Worker,
    subs: list[Subscription],
    tasks: list[asyncio.Task[None]],
) -> None:
    """Serve ``work.<id>`` and ``cancel.>`` (plus the role's own ``subs`` and ``tasks``) and
    beat until SIGTERM; then drain running requests and close. The decode and prefill mains.
    A standby worker (``worker.standby``) waits, loaded and connected, for SIGUSR1 first."""
    if worker.settings.worker.standby and not await standby(ctx, worker):
        for t in tasks:
            t.cancel()
        for s in subs:
            await s.unsubscribe()
        await nc.drain()
        await worker.backend.stop()
        return
    ctx.serving(lambda: nc.is_connected and not worker.draining)

    async def on_drain(msg: Msg) -> None:
        try:
            d = decode(msg.data, DrainRequest)
        except ProtocolError as e:
            log.warning("bad drain request", extra=fields(subject=msg.subject, error=str(e)))
            return
        log.info("drain requested", extra=fields(worker_id=d.worker_id, reason=d.reason))
        if msg.reply:
            await nc.publish(msg.reply, encode(AssignmentAck(accepted=True, reason="draining")))
        ctx.stopping.set()  # the SIGTERM path: drain, then exit

    subs += [
        await nc.subscribe(worker.subjects.work(worker.worker_id), cb=worker.on_assignment),
        await nc.subscribe(worker.subjects.cancel_all, cb=worker.on_cancel),
        await nc.subscribe(worker.subjects.resend_all, cb=worker.on_resend),
        await nc.subscribe(worker.subjects.drain(worker.worker_id), cb=on_drain),
        await nc.subscribe(worker.subjects.teams_changed, cb=worker.on_teams_changed),
    ]
    # Beats go on while draining (they say so, and keep the router from moving requests that
    # are finishing here); they stop once the drain is over.
    beats_stop = asyncio.Event()
    tasks.append(asyncio.create_task(worker.beat_loop(beats_stop)))
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
        await ctx.stopping.wait()
        await worker.drain(worker.settings.worker.drain_timeout_s)
    finally:
        beats_stop.set()
        for t in tasks:
            t.cancel()
        for s in subs:
            await s.unsubscribe()
        await worker.flush_usage(worker.settings.worker.usage_publish_timeout_s)
        await nc.drain()
        await worker.backend.stop()


# Set by SIGUSR1 (``arm_standby``): a standby worker may be told to serve while it still loads.
_ACTIVATED = threading.Event()
# Seconds between a standby worker's looks at that flag.
STANDBY_POLL_S = 0.05


def arm_standby(settings: Settings) -> None:
    """Before anything loads: a standby worker's SIGUSR1 only sets a flag (its default action
    would end the process)."""
    if settings.worker.standby:
        signal.signal(signal.SIGUSR1, lambda _sig, _frame: _ACTIVATED.set())


async def standby(ctx: ServiceContext, worker: Worker) -> bool:
    """Warm standby (docs/planner.md): the model is loaded and NATS connected, but the worker
    neither beats nor subscribes to work, so nothing is routed to it. ``strait up``'s
    supervisor sends SIGUSR1 when the planner wants one more worker; True once activated,
    False when stopped first."""
    log.info("worker on standby", extra=fields(worker_id=worker.worker_id, pool=worker.pool))
    while not _ACTIVATED.is_set():
        with contextlib.suppress(TimeoutError):  # the flag is set from a signal handler
            await asyncio.wait_for(ctx.stopping.wait(), STANDBY_POLL_S)
        if ctx.stopping.is_set():
            return False
    log.info("worker activated", extra=fields(worker_id=worker.worker_id, pool=worker.pool))
    return True


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    arm_standby(settings)
    return run_service("worker", serve, settings, http_port=settings.worker.metrics_port)
