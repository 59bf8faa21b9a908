"""``strait worker``: one worker process of the role ``worker.role`` says.

- ``aggregated`` (the default): prefill + decode here (``AggregatedWorker``);
- ``decode``: a disaggregated pool's decode side; requests arrive as KV handoffs from prefill
  workers (``DecodeWorker`` + ``HandoffReceiver``);
- ``prefill``: a disaggregated pool's prefill side, with the prefix-cache service's client when
  ``cache.enabled`` (``PrefillWorker``); ``strait prefill`` is ``strait worker`` of this role.

Connects to NATS, loads its backend (the real engine, or the FAKE one when the pool says
``backend = "fake"``; the disaggregated roles need the engine), then serves ``work.<worker_id>``,
``cancel.>``, ``resend.>`` and ``admin.teams`` and beats until SIGTERM or a ``DrainRequest`` on
``admin.drain.<worker_id>`` (``strait drain``): both drain, then exit.
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
from libs.protocol import AssignmentAck, DrainRequest
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.endpoint import Endpoint, logs
from services.worker.aggregated import AggregatedWorker
from services.worker.base import Worker
from services.worker.decode import DecodeWorker
from services.worker.handoff import HandoffReceiver
from services.worker.prefill import PrefillWorker, PrefixCache

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


def cache_client(nc: object, settings: Settings) -> PrefixCache | None:
    if not settings.cache.enabled:
        return None
    from libs.kv_cache_client import CacheClient

    return CacheClient(nc, settings)  # type: ignore[arg-type]


async def serve(ctx: ServiceContext) -> None:
    """An aggregated or decode worker (``worker.role``); a prefill worker: :func:`serve_prefill`."""
    settings = ctx.settings
    backend = build_backend(settings)
    await backend.start()
    nc = await connect(settings.nats, f"worker-{settings.worker.pool}")
    subs: list[Subscription] = []
    tasks: list[asyncio.Task[None]] = []
    worker: Worker
    if settings.worker.role == "decode":  # disaggregated: requests arrive as KV handoffs
        if not isinstance(backend, AsyncEngineBackend):
            raise SystemExit("worker.role = 'decode' needs backend = 'engine' (KV handoff)")
        worker = DecodeWorker(nc, settings, backend)
        receiver = HandoffReceiver(worker, backend)
        subs += await receiver.subscribe()
        tasks.append(asyncio.create_task(receiver.sweep_loop(ctx.stopping)))
    else:
        worker = AggregatedWorker(nc, settings, backend)
    await run_worker(ctx, nc, worker, subs, tasks)


async def serve_prefill(ctx: ServiceContext) -> None:
    """A prefill worker: the engine (a KV handoff needs it) and the cache service's client."""
    settings = ctx.settings.model_copy(deep=True)
    settings.worker.role = "prefill"
    pool = settings.pool(settings.worker.pool)
    if pool is None:
        raise SystemExit(f"worker.pool {settings.worker.pool!r} is not in settings.pools")
    if pool.backend != "engine":
        raise SystemExit("a prefill worker needs backend = 'engine' (KV handoff)")
    backend = engine_backend(settings, pool)
    await backend.start()
    nc = await connect(settings.nats, f"prefill-{pool.name}")
    worker = PrefillWorker(nc, settings, backend, cache_client(nc, settings))
    await run_worker(ctx, nc, worker, [], [])


async def run_worker(
    ctx: ServiceContext,
    nc: NATS,
    worker: Worker,
    subs: list[Subscription],
    tasks: list[asyncio.Task[None]],
) -> None:
    """Serve the worker's endpoints (plus the role's own ``subs`` and ``tasks``) and beat
    until SIGTERM; then drain running requests and close. Every role's serve ends here.
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

    async def on_drain(d: DrainRequest, msg: Msg) -> AssignmentAck:
        log.info("drain requested", extra=fields(worker_id=d.worker_id, reason=d.reason))
        ctx.stopping.set()  # the SIGTERM path: drain, then exit (after this answer)
        return AssignmentAck(accepted=True, reason="draining")

    drain = Endpoint("worker.drain", DrainRequest, on_drain, logs(log, "bad drain request"))
    endpoints = [*worker.endpoints(), (worker.subjects.drain(worker.worker_id), drain)]
    subs += [await ep.subscribe(nc, subject) for subject, ep in endpoints]
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
    would end the process). `strait up` starts a standby with SIGUSR1 blocked, so one sent
    before this point is pending, and is delivered here, once the handler is in place."""
    if settings.worker.standby:
        signal.signal(signal.SIGUSR1, lambda _sig, _frame: _ACTIVATED.set())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


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


def main(settings: Settings | None = None, role: str | None = None) -> int:
    """``strait worker [--role ROLE]`` (``role`` overrides ``worker.role``); ``strait decode``
    is ``strait worker``, ``strait prefill`` is ``strait worker --role prefill``."""
    settings = settings or get_settings()
    if role is not None:
        settings = settings.model_copy(deep=True)
        settings.worker.role = role  # type: ignore[assignment]
    arm_standby(settings)
    if settings.worker.role == "prefill":
        name, run = "prefill", serve_prefill
    else:
        name, run = "worker", serve
    return run_service(name, run, settings, http_port=settings.worker.metrics_port)
