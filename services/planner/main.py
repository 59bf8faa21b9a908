"""``strait planner``: sizes every pool ahead of its load (docs/planner.md).

    subscribe: workers.>  (WorkerBeat)        events.route  (RouteDecision, placed requests)
               routers.* (RouterBeat: requests held in routers, queued)
               events.usage.worker (UsageEvent) requests, requests.* (model names: demand for
                                                a pool with no worker)
    every planner.interval_s, or at once when a RouterBeat reports new holds:
        Planner.plan → PlanDecision per pool role
        → planner.decision.<pool>.<role> (core NATS) → log (one line per change) → actuator

The planner holds no worker and no request: if it dies, nothing is lost and the actuators keep
the fleet the size it has; when it starts again it begins from the workers it sees beating.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.log import fields
from libs.protocol import (
    PlanDecision,
    RouteDecision,
    RouterBeat,
    Subjects,
    UsageEvent,
    WorkerBeat,
    encode,
)
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from libs.wire.nats_util import connect
from services.endpoint import Endpoint, logs
from services.planner import metrics
from services.planner.actuators import build_actuator
from services.planner.planner import Planner

log = logging.getLogger("strait.planner")
T = TypeVar("T")
# Workers not heard from for this many beat TTLs are forgotten.
FORGET_TTLS = 100


class _RequestModel(msgspec.Struct):
    """The only field of a GenerateRequest the planner reads."""

    model: str = "auto"


_request_model = msgspec.json.Decoder(_RequestModel)


async def serve(ctx: ServiceContext) -> None:
    s = ctx.settings
    subjects = Subjects.of(s.nats)
    planner_id = f"planner-{socket.gethostname()}-{os.getpid()}"
    planner = Planner(s, planner_id, time.monotonic())
    actuate = build_actuator(s)
    nc = await connect(s.nats, "planner")

    wake = asyncio.Event()
    subs = await subscribe(nc, subjects, planner, wake)
    ctx.serving(lambda: nc.is_connected)
    log.info(
        "planner ready",
        extra=fields(
            planner_id=planner_id,
            actuator=s.planner.actuator,
            method=s.planner.forecast_method,
            pools=",".join(p.name for p in s.pools),
        ),
    )
    last: dict[tuple[str, str], tuple[int, str]] = {}
    try:
        while not ctx.stopping.is_set():
            wake.clear()
            now = time.monotonic()
            decisions = await asyncio.to_thread(planner.plan, now)
            for d in decisions:
                await publish(nc, subjects, d)
                record(d, last)
                if actuate is not None:
                    try:
                        await asyncio.to_thread(actuate, d)
                    except Exception as e:  # an API error: the next tick tries again
                        log.warning("actuator failed", extra=fields(pool=d.pool, error=repr(e)))
            planner.forget_stale(now, s.fleet.worker_ttl_s * FORGET_TTLS)
            waits = [asyncio.ensure_future(e.wait()) for e in (ctx.stopping, wake)]
            await asyncio.wait(waits, timeout=s.planner.interval_s, return_when="FIRST_COMPLETED")
            for w in waits:
                w.cancel()
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.drain()


async def subscribe(
    nc: NATS, subjects: Subjects, planner: Planner, wake: asyncio.Event
) -> list[Subscription]:
    """The planner's subscriptions (``serve``, at start): beats, routes, router beats and
    usage handed to ``planner`` with their arrival time, and requests read for their model
    alone. A router beat with new holds sets ``wake``."""
    unreadable = logs(log, "unreadable message", logging.DEBUG)

    def feeds(name: str, type_: type[T], feed: Callable[[T, float], None]) -> Endpoint[T]:
        """An endpoint that hands each message to the planner with its arrival time."""

        async def on(ev: T, msg: Msg) -> None:
            feed(ev, time.monotonic())

        return Endpoint(f"planner.{name}", type_, on, unreadable)

    # Requests are read for their model alone (no full decode): hand-written.
    async def on_request(msg: Msg) -> None:
        try:
            model = _request_model.decode(msg.data).model
        except msgspec.DecodeError:
            return
        planner.on_request_model(model, time.monotonic())

    # A router that begins holding requests (every worker of a pool full) wakes the loop: the
    # decision goes out within a router beat, not at the next planner.interval_s tick.
    def on_router_beat(beat: RouterBeat, now: float) -> None:
        planner.on_router_beat(beat, now)
        if beat.held_arrivals:
            wake.set()

    return [
        await feeds("beat", WorkerBeat, planner.on_beat).subscribe(nc, subjects.beats_all),
        await feeds("route", RouteDecision, planner.on_route).subscribe(
            nc, subjects.event("route")
        ),
        await feeds("router_beat", RouterBeat, on_router_beat).subscribe(
            nc, subjects.router_beats_all
        ),
        await feeds("usage", UsageEvent, planner.on_usage).subscribe(nc, subjects.worker_usage),
        await nc.subscribe(subjects.requests, cb=on_request),
        await nc.subscribe(subjects.team_requests_all, cb=on_request),
    ]


async def publish(nc: object, subjects: Subjects, d: PlanDecision) -> None:
    await nc.publish(subjects.plan(d.pool, d.role), encode(d))  # type: ignore[attr-defined]


def record(d: PlanDecision, last: dict[tuple[str, str], tuple[int, str]]) -> None:
    """Metrics for every decision; a log line when the target or the reason changes (a steady
    pool is one line, not one a tick)."""
    metrics.REPLICAS.labels(pool=d.pool, role=d.role).set(d.replicas)
    metrics.CURRENT.labels(pool=d.pool, role=d.role).set(d.current)
    metrics.FORECAST.labels(pool=d.pool).set(d.forecast_rps)
    metrics.ARRIVALS.labels(pool=d.pool).set(d.arrival_rps)
    metrics.DECISIONS.labels(pool=d.pool, role=d.role, reason=d.reason).inc()
    key = (d.pool, d.role)
    if last.get(key) == (d.replicas, d.reason):
        return
    last[key] = (d.replicas, d.reason)
    log.info(
        "plan",
        extra=fields(
            pool=d.pool,
            role=d.role,
            replicas=d.replicas,
            current=d.current,
            reason=d.reason,
            driver=d.driver,
            arrival_rps=d.arrival_rps,
            forecast_rps=d.forecast_rps,
            queue=d.queue,
            worker_rps=d.worker_rps,
            capacity=d.capacity,
            ttft_s=d.ttft_s,
            itl_s=d.itl_s,
            factors=" ".join(d.factors),
        ),
    )


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    return run_service("planner", serve, settings, http_port=settings.planner.metrics_port)
