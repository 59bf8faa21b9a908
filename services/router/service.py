"""The router service: pull requests from JetStream, place them, keep the worker registry fresh.

``RouterService.start`` connects, provisions the streams and the consumer, builds the
``Router`` and subscribes its handlers; ``run`` serves until the service stops; ``close`` stops
everything it started. ``main.py`` only wires it into the process. Four things run side by side:

- the request loops (``read_requests``), one for the fleet's requests stream and one for each
  active team's (``team_streams``, ``team_stream_config``): fetch a batch from the stream's
  durable consumer ``router`` (replicas share it, so each request is routed once) →
  ``Router.handle`` each concurrently (bounded, across all streams) → ack;
- subscriptions to every worker's beats and KV events, feeding the registry (each replica
  builds the same registry from the same subjects), and to stream owners, cancels and team
  changes (``on_*``);
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

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.log import fields
from libs.protocol import (
    CancelRequest,
    GenerateRequest,
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
from libs.runtime import ServiceContext
from libs.wire.nats_util import (
    connect,
    ensure_consumer,
    ensure_team_streams,
    provision,
    regional_name,
    team_stream_name,
    work_queue_consumer,
)
from libs.wire.pull import PullEndpoint
from services.endpoint import Endpoint, ignores, logs
from services.router import metrics
from services.router.router import Router

log = logging.getLogger("strait.router")

ROUTER_DURABLE = "router"
FETCH_BATCH = 32
MAX_CONCURRENT_DECISIONS = 64
DRAIN_INFLIGHT_S = 10.0  # at stop: how long decisions under way may take to finish


class RouterService:
    """One router process: its connection, registry, ``Router`` and the tasks it runs."""

    def __init__(self, ctx: ServiceContext, nc: NATS, js: JetStreamContext) -> None:
        s = self.settings = ctx.settings
        self.ctx, self.nc, self.js = ctx, nc, js
        self.subjects = Subjects.of(s.nats)
        self.ack_wait = s.router.assign_timeout_s * 4 + 5
        # A region's router reads its region's stream (placed in its cluster; docs/regions.md).
        self.requests_stream = regional_name(s.nats, s.nats.requests_stream)
        self.registry = WorkerRegistry(
            s.fleet.worker_ttl_s, s.router.worker_return_wait_s, s.router.worker_stall_s
        )
        self.router = Router(nc, js, s, self.registry)
        self.slots = self.router.slots = asyncio.Semaphore(MAX_CONCURRENT_DECISIONS)
        self.inflight: set[asyncio.Task[None]] = set()
        self.readers: dict[str, asyncio.Task[None]] = {}  # team → its stream's request loop
        self.tasks: list[asyncio.Task[None]] = []  # the sweep and the beat
        self.router_id = f"router-{socket.gethostname()}-{os.getpid()}"

    @classmethod
    async def start(
        cls, ctx: ServiceContext, on_router: Callable[[Router], None] | None = None
    ) -> RouterService:
        """Connect, provision, build the ``Router`` (handed to ``on_router``: tests) and
        subscribe; the request loops start in ``run``."""
        nc = await connect(ctx.settings.nats, "router")
        js = nc.jetstream()
        await provision(js, ctx.settings.nats)
        service = cls(ctx, nc, js)
        if on_router is not None:
            on_router(service.router)
        await service.subscribe()
        return service

    async def subscribe(self) -> None:
        """The requests consumer and the subscriptions of the handlers below."""
        subjects, nats = self.subjects, self.settings.nats
        # (Requests a team sent before its own stream existed are still read from here.)
        only = (
            [subjects.requests] if nats.region else [subjects.requests, subjects.team_requests_all]
        )
        consumer = work_queue_consumer(ROUTER_DURABLE, only, self.ack_wait)
        await ensure_consumer(self.js, self.requests_stream, consumer)
        endpoints: list[tuple[str, Endpoint[Any]]] = [
            (
                subjects.beats_all,
                Endpoint("router.beat", WorkerBeat, self.on_beat, logs(log, "bad beat")),
            ),
            (
                subjects.starting_all,
                Endpoint(
                    "router.starting",
                    WorkerStarting,
                    self.on_starting,
                    logs(log, "bad announcement"),
                ),
            ),
            (
                subjects.stream_owner,
                Endpoint("router.owner", StreamOwner, self.on_owner, logs(log, "bad stream owner")),
            ),
            # A malformed cancel is the workers' to dead-letter.
            (
                subjects.cancel_all,
                Endpoint("router.cancel", CancelRequest, self.on_cancel, ignores),
            ),
            (
                subjects.kv_events_all,
                Endpoint("router.kv", KvEvent, self.on_kv, logs(log, "bad kv event")),
            ),
            (
                subjects.teams_changed,
                Endpoint(
                    "router.teams_changed",
                    TeamsChanged,
                    self.on_teams_changed,
                    logs(log, "bad teams message"),
                ),
            ),
        ]
        for subject, endpoint in endpoints:
            await endpoint.subscribe(self.nc, subject)

    async def run(self) -> None:
        """Read the fleet's requests stream (and the teams') until the service stops, with the
        sweep and the beat beside."""
        psub = await self.js.pull_subscribe_bind(ROUTER_DURABLE, self.requests_stream)
        await self.team_streams()
        self.ctx.serving(lambda: self.nc.is_connected)
        self.tasks = [asyncio.create_task(self.sweep()), asyncio.create_task(self.beat())]
        s = self.settings
        log.info(
            "router ready", extra=fields(pools=[p.name for p in s.pools], region=s.nats.region)
        )
        await self.read_requests(self.requests_stream, psub)

    async def close(self) -> None:
        """Stop the sweep, the beat and the request loops; let decisions under way finish (up
        to ``DRAIN_INFLIGHT_S``); drain the connection."""
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for reader in self.readers.values():
            reader.cancel()
        await asyncio.gather(*self.readers.values(), return_exceptions=True)
        if self.inflight:
            await asyncio.wait(self.inflight, timeout=DRAIN_INFLIGHT_S)
        await self.router.watch.close()
        await self.nc.drain()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self.inflight.add(t)
        t.add_done_callback(self.inflight.discard)

    # ------------------------------------------------------------------ requests

    async def handle(self, msg: Msg) -> None:
        try:
            await self.router.handle(msg)
        except Exception:
            log.exception("routing failed")
        finally:
            self.slots.release()

    async def read_requests(self, stream: str, psub: JetStreamContext.PullSubscription) -> None:
        """Fetch ``stream``'s requests and route each, until the service stops. A deleted
        consumer ends the loop (a sweep, or a restart, provisions it again)."""
        # Router.handle decodes each request itself: a bad one is answered, not only dropped.
        ep = PullEndpoint("router.requests", GenerateRequest, psub, log, context={"stream": stream})
        try:
            while not self.ctx.stopping.is_set():
                for m in await ep.fetch(FETCH_BATCH):
                    await self.slots.acquire()
                    self.spawn(self.handle(m))
        finally:
            await ep.close()

    async def team_streams(self) -> None:
        """Each active team's requests stream and its loop (a team added by editing the teams
        file alone, as in Kubernetes, is picked up here within a sweep)."""
        self.router.teams.reload()
        for team, reader in list(self.readers.items()):
            if reader.done():  # its consumer was deleted: provision it again
                self.readers.pop(team)
                if not reader.cancelled() and reader.exception() is not None:
                    log.warning(
                        "team's request loop ended",
                        extra=fields(team=team, error=repr(reader.exception())),
                    )
        new = sorted(set(self.router.teams.limits) - set(self.readers))
        if not new:
            return
        nats = self.settings.nats
        try:
            await ensure_team_streams(self.js, nats, new)
            for team in new:
                stream = team_stream_name(nats, team)
                only = [self.subjects.team_requests(team)]
                await ensure_consumer(
                    self.js, stream, work_queue_consumer(ROUTER_DURABLE, only, self.ack_wait)
                )
                psub = await self.js.pull_subscribe_bind(ROUTER_DURABLE, stream)
                self.readers[team] = asyncio.create_task(self.read_requests(stream, psub))
        except Exception as e:  # JetStream busy or reconnecting: the next sweep tries again
            log.warning("team streams not ready", extra=fields(error=repr(e)))
            return
        log.info("reading teams' requests", extra=fields(teams=new))

    # ------------------------------------------------------------------ subscriptions

    async def on_beat(self, beat: WorkerBeat, msg: Msg) -> None:
        self.registry.on_beat(beat)

    async def on_starting(self, ann: WorkerStarting, msg: Msg) -> None:
        """A worker announced its loading stage: routers wait for it while it progresses."""
        self.registry.on_starting(ann)

    async def on_kv(self, ev: KvEvent, msg: Msg) -> None:
        self.registry.on_kv_event(ev)

    async def on_owner(self, o: StreamOwner, msg: Msg) -> None:
        self.router.watch.owner(request_key(o.origin, o.request_id), o.worker_id)

    async def on_cancel(self, c: CancelRequest, msg: Msg) -> None:
        """A client's cancel ends its stream without a last message: stop watching it (or a
        stall would move a request nobody reads). The router's own targeted cancels name a
        worker and leave the watch alone."""
        try:
            team, rid = self.subjects.addressed(msg.subject, "cancel", c.request_id)
        except ValueError:
            return  # the workers dead-letter it
        # A team's cancel (cancel.<team>.<id>) counts only for that team's request of that id.
        if not c.worker_id:
            await self.router.watch.forget(request_key(team, rid))

    async def on_teams_changed(self, tc: TeamsChanged, msg: Msg) -> None:
        """The workers cancel the revoked teams' running requests; the router refuses their
        queued ones and stops watching the rest."""
        self.router.teams.revoke(tc.revoked)
        for key, w in list(self.router.watch.watched.items()):
            if w.req.team in tc.revoked:
                await self.router.watch.forget(key)
        await self.team_streams()
        log.info("teams changed", extra=fields(revoked=tc.revoked))

    # ------------------------------------------------------------------ periodic

    async def replace(self, worker_id: str) -> None:
        try:
            await self.router.worker_lost(worker_id)
        except Exception:
            log.exception("re-placement failed", extra=fields(worker_id=worker_id))

    async def sweep(self) -> None:
        reconnects = self.nc.stats["reconnects"]
        while True:
            await asyncio.sleep(self.settings.router.sweep_interval_s)
            if not self.nc.is_connected:
                # No beats can arrive: expiring now would move every request of live workers.
                continue
            if self.nc.stats["reconnects"] != reconnects:
                # Back after a cut: workers get a whole TTL to beat again, and streams watched
                # across the cut may have lost messages (they cannot seed a migration).
                reconnects = self.nc.stats["reconnects"]
                self.registry.refresh()
                self.router.watch.reconnected()
            for gone in self.registry.expire():
                log.info("worker expired", extra=fields(worker_id=gone))
                self.spawn(self.replace(gone))
            await self.router.watch.sweep()
            self.spawn(self.router.stalled_streams())  # a move may wait for a worker to come back
            await self.team_streams()
            self.export_metrics()

    def export_metrics(self) -> None:
        """Watched requests, and live workers by pool and region."""
        metrics.WATCHED.set(len(self.router.watch.watched))
        registry = self.registry
        regions = {self.settings.nats.region} | {v.beat.region for v in registry.workers.values()}
        for pool in {p.name for p in self.settings.pools} | registry.pools():
            live = registry.live(pool)
            for region in regions:
                n = sum(1 for v in live if v.beat.region == region)
                metrics.LIVE_WORKERS.labels(pool=pool, region=region).set(n)

    async def beat(self) -> None:
        subject = self.subjects.router_beat(self.router_id)
        while True:
            await asyncio.sleep(self.settings.router.beat_interval_s)
            if self.nc.is_connected:
                with contextlib.suppress(Exception):
                    await self.nc.publish(subject, encode(self.router.beat(self.router_id)))
