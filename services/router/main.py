"""``strait router``: pull requests from JetStream, place them, keep the worker registry fresh.

Four things run side by side:

- the request loops, one for the fleet's requests stream and one for each active team's
  (``team_stream_config``): fetch a batch from the stream's durable consumer ``router``
  (replicas share it, so each request is routed once) → ``Router.handle`` each concurrently
  (bounded, across all streams) → ack;
- subscriptions to every worker's beats and KV events, feeding the registry (each replica builds
  the same registry from the same subjects);
- the sweep, every ``router.sweep_interval_s``: expire workers whose beats stopped, place their
  not-yet-started requests again, forget watched requests past ``router.watch_ttl_s``;
- the beat, every ``router.beat_interval_s``: a ``RouterBeat`` with the requests it holds
  (``Router.hold_while_full``), which the planner counts as queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError, NotFoundError

from libs.log import fields
from libs.nats_util import (
    connect,
    ensure_consumer,
    ensure_team_streams,
    provision,
    regional_name,
    team_stream_name,
    work_queue_consumer,
)
from libs.protocol import (
    CancelRequest,
    KvEvent,
    StreamOwner,
    Subjects,
    TeamsChanged,
    WorkerBeat,
    WorkerStarting,
    encode,
    request_key,
)
from libs.registry import WorkerRegistry
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.endpoint import Endpoint, ignores, logs
from services.router import metrics
from services.router.router import Router

log = logging.getLogger("strait.router")

ROUTER_DURABLE = "router"
FETCH_BATCH = 32
FETCH_TIMEOUT_S = 0.5
FETCH_RETRY_S = 0.5  # pause after a fetch JetStream refused (server restarting, reconnecting)
MAX_CONCURRENT_DECISIONS = 64


async def serve(ctx: ServiceContext, on_router: Callable[[Router], None] | None = None) -> None:
    """The router service body; ``on_router`` (tests) receives the Router once it is built."""
    s = ctx.settings
    subjects = Subjects.of(s.nats)
    nc = await connect(s.nats, "router")
    js = nc.jetstream()
    await provision(js, s.nats)
    ack_wait = s.router.assign_timeout_s * 4 + 5
    # (Requests a team sent before its own stream existed are still read from here.)
    # A region's router reads its region's stream (placed in its cluster; docs/regions.md).
    requests_stream = regional_name(s.nats, s.nats.requests_stream)
    only = [subjects.requests] if s.nats.region else [subjects.requests, subjects.team_requests_all]
    consumer = work_queue_consumer(ROUTER_DURABLE, only, ack_wait)
    await ensure_consumer(js, requests_stream, consumer)
    registry = WorkerRegistry(
        s.fleet.worker_ttl_s, s.router.worker_return_wait_s, s.router.worker_stall_s
    )
    router = Router(nc, js, s, registry)
    if on_router is not None:
        on_router(router)
    slots = router.slots = asyncio.Semaphore(MAX_CONCURRENT_DECISIONS)
    inflight: set[asyncio.Task[None]] = set()
    readers: dict[str, asyncio.Task[None]] = {}  # team → its stream's request loop

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        inflight.add(t)
        t.add_done_callback(inflight.discard)

    async def handle(msg: Msg) -> None:
        try:
            await router.handle(msg)
        except Exception:
            log.exception("routing failed")
        finally:
            slots.release()

    async def read_requests(stream: str, psub: JetStreamContext.PullSubscription) -> None:
        """Fetch ``stream``'s requests and route each, until the service stops."""
        try:
            while not ctx.stopping.is_set():
                try:
                    msgs = await psub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
                except (FetchTimeoutError, NatsTimeout, TimeoutError):
                    continue
                except NotFoundError:
                    raise  # the consumer is gone: fail, and a restart provisions it again
                except NatsError as e:
                    # A server shutting down answers a pending fetch with 503
                    # (ServiceUnavailable); the connection reconnects and fetching works again.
                    log.warning(
                        "fetching requests failed; retrying",
                        extra=fields(stream=stream, error=repr(e)),
                    )
                    await asyncio.sleep(FETCH_RETRY_S)
                    continue
                for m in msgs:
                    await slots.acquire()
                    spawn(handle(m))
        finally:
            # NOTE: a pull subscription's queue keeps the fetch status messages it never hands
            # out, so draining it waits for drain_timeout; nothing is pending, drop it first.
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def team_streams() -> None:
        # Each active team's requests stream and its loop (a team added by editing the
        # teams file alone, as in Kubernetes, is picked up here within a sweep).
        router.teams.reload()
        for team, reader in list(readers.items()):
            if reader.done():  # its consumer was deleted: provision it again
                readers.pop(team)
                if not reader.cancelled() and reader.exception() is not None:
                    log.warning(
                        "team's request loop ended",
                        extra=fields(team=team, error=repr(reader.exception())),
                    )
        new = sorted(set(router.teams.limits) - set(readers))
        if not new:
            return
        try:
            await ensure_team_streams(js, s.nats, new)
            for team in new:
                stream = team_stream_name(s.nats, team)
                only = [subjects.team_requests(team)]
                await ensure_consumer(
                    js, stream, work_queue_consumer(ROUTER_DURABLE, only, ack_wait)
                )
                psub = await js.pull_subscribe_bind(ROUTER_DURABLE, stream)
                readers[team] = asyncio.create_task(read_requests(stream, psub))
        except Exception as e:  # JetStream busy or reconnecting: the next sweep tries again
            log.warning("team streams not ready", extra=fields(error=repr(e)))
            return
        log.info("reading teams' requests", extra=fields(teams=new))

    async def on_beat(beat: WorkerBeat, msg: Msg) -> None:
        registry.on_beat(beat)

    async def on_starting(ann: WorkerStarting, msg: Msg) -> None:
        registry.on_starting(ann)

    async def on_kv(ev: KvEvent, msg: Msg) -> None:
        registry.on_kv_event(ev)

    async def on_owner(o: StreamOwner, msg: Msg) -> None:
        router.watch.owner(request_key(o.origin, o.request_id), o.worker_id)

    async def on_cancel(c: CancelRequest, msg: Msg) -> None:
        # A client's cancel ends its stream without a last message: stop watching it (or a
        # stall would move a request nobody reads). The router's own targeted cancels name a
        # worker and leave the watch alone.
        try:
            team, rid = subjects.addressed(msg.subject, "cancel", c.request_id)
        except ValueError:
            return  # the workers dead-letter it
        # A team's cancel (cancel.<team>.<id>) counts only for that team's request of that id.
        if not c.worker_id:
            await router.watch.forget(request_key(team, rid))

    async def on_teams_changed(tc: TeamsChanged, msg: Msg) -> None:
        # The workers cancel the revoked teams' running requests; the router refuses their
        # queued ones and stops watching the rest.
        router.teams.revoke(tc.revoked)
        for key, w in list(router.watch.watched.items()):
            if w.req.team in tc.revoked:
                await router.watch.forget(key)
        await team_streams()
        log.info("teams changed", extra=fields(revoked=tc.revoked))

    endpoints: list[tuple[str, Endpoint[Any]]] = [
        (subjects.beats_all, Endpoint("router.beat", WorkerBeat, on_beat, logs(log, "bad beat"))),
        (
            subjects.starting_all,
            Endpoint("router.starting", WorkerStarting, on_starting, logs(log, "bad announcement")),
        ),
        (
            subjects.stream_owner,
            Endpoint("router.owner", StreamOwner, on_owner, logs(log, "bad stream owner")),
        ),
        # A malformed cancel is the workers' to dead-letter.
        (subjects.cancel_all, Endpoint("router.cancel", CancelRequest, on_cancel, ignores)),
        (subjects.kv_events_all, Endpoint("router.kv", KvEvent, on_kv, logs(log, "bad kv event"))),
        (
            subjects.teams_changed,
            Endpoint(
                "router.teams_changed",
                TeamsChanged,
                on_teams_changed,
                logs(log, "bad teams message"),
            ),
        ),
    ]
    for subject, endpoint in endpoints:
        await endpoint.subscribe(nc, subject)
    psub = await js.pull_subscribe_bind(ROUTER_DURABLE, requests_stream)
    await team_streams()
    ctx.serving(lambda: nc.is_connected)

    async def replace(worker_id: str) -> None:
        try:
            await router.worker_lost(worker_id)
        except Exception:
            log.exception("re-placement failed", extra=fields(worker_id=worker_id))

    async def sweep() -> None:
        reconnects = nc.stats["reconnects"]
        while True:
            await asyncio.sleep(s.router.sweep_interval_s)
            if not nc.is_connected:
                # No beats can arrive: expiring now would move every request of live workers.
                continue
            if nc.stats["reconnects"] != reconnects:
                # Back after a cut: workers get a whole TTL to beat again, and streams watched
                # across the cut may have lost messages (they cannot seed a migration).
                reconnects = nc.stats["reconnects"]
                registry.refresh()
                router.watch.reconnected()
            for gone in registry.expire():
                log.info("worker expired", extra=fields(worker_id=gone))
                spawn(replace(gone))
            await router.watch.sweep()
            spawn(router.stalled_streams())  # a move may wait for a worker to come back
            await team_streams()
            metrics.WATCHED.set(len(router.watch.watched))
            regions = {s.nats.region} | {v.beat.region for v in registry.workers.values()}
            for pool in {p.name for p in s.pools} | registry.pools():
                live = registry.live(pool)
                for region in regions:
                    n = sum(1 for v in live if v.beat.region == region)
                    metrics.LIVE_WORKERS.labels(pool=pool, region=region).set(n)

    router_id = f"router-{socket.gethostname()}-{os.getpid()}"

    async def beat() -> None:
        while True:
            await asyncio.sleep(s.router.beat_interval_s)
            if nc.is_connected:
                with contextlib.suppress(Exception):
                    await nc.publish(
                        subjects.router_beat(router_id), encode(router.beat(router_id))
                    )

    sweeper = asyncio.create_task(sweep())
    beater = asyncio.create_task(beat())
    log.info("router ready", extra=fields(pools=[p.name for p in s.pools], region=s.nats.region))
    try:
        await read_requests(requests_stream, psub)
    finally:
        sweeper.cancel()
        beater.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        with contextlib.suppress(asyncio.CancelledError):
            await beater
        for reader in readers.values():
            reader.cancel()
        await asyncio.gather(*readers.values(), return_exceptions=True)
        if inflight:
            await asyncio.wait(inflight, timeout=10)
        await router.watch.close()
        await nc.drain()


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    return run_service("router", serve, settings, http_port=settings.router.metrics_port)
