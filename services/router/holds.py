"""The router's holds: requests it keeps (unacked in JetStream, kept alive) instead of placing
them at once. ``Router`` (services/router/router.py) inherits them; ``Router.place`` calls
them before it decides.

- ``hold_while_full``: late binding (decision 0026): a new request waits while every worker of
  its pool is full, and goes to the first with room, a worker that starts meanwhile included;
  held requests leave in fair-share order between tenants (flow control, decision 0034);
- ``hold_batch``: a ``priority: "batch"`` request waits while interactive work leaves no room
  (decision 0024);
- ``beat``: what the router holds, published as a ``RouterBeat`` for the planner.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libs.engine.params import PRIORITY_BANDS
from libs.protocol import GenerateRequest, RouterBeat
from libs.registry import WorkerRegistry
from libs.settings import RouterSettings, Settings
from services.router import metrics
from services.router.decision import PoolChoice, Rejection
from services.router.flow import TenantFlow


@dataclass(eq=False)
class HeldRequest:
    """One request held for room in its pool (identity-compared)."""

    tenant: str
    band: int  # its priority's index in PRIORITY_BANDS (0: interactive)
    since: float  # time.monotonic() when it was held


class Refused(Exception):
    """Flow control ended a held request (over_share, deadline_exceeded): ``Router.place``
    answers it with ``rejection``."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class Holds:
    """Mixed into ``Router``, which sets these attributes in its ``__init__``."""

    settings: Settings
    cfg: RouterSettings
    registry: WorkerRegistry
    # Requests held while every worker of their pool is full, by pool, oldest first; and
    # those held since the last RouterBeat.
    held: dict[str, list[HeldRequest]]
    held_arrivals: dict[str, int]
    # Requests waiting for a worker to come back to their pool (Router.decide_waiting).
    waiting: dict[str, int]
    flow: TenantFlow

    def choose_pool(self, req: GenerateRequest) -> PoolChoice | None:
        raise NotImplementedError

    def batch_room(self, pool: str) -> bool:
        """Interactive work leaves room in ``pool`` for a batch request: no request waits in
        its workers (beats) and more than ``batch.reserve_slots`` slots are free, counting
        the assignments made since the last beats. No live worker: ``decide`` answers."""
        workers = self.registry.live(pool)
        if not workers:
            return True
        waiting = sum(w.beat.waiting for w in workers)
        free = sum(w.beat.capacity - w.beat.running - len(w.pending_at) for w in workers)
        return waiting == 0 and free > self.settings.batch.reserve_slots

    async def hold_batch(
        self,
        req: GenerateRequest,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        held: asyncio.Semaphore | None = None,
    ) -> None:
        """Hold a ``priority: "batch"`` request (unacked, kept alive) while its pool has no
        room for it (``batch_room``), up to ``router.batch_hold_max_s``; its decision slot is
        given back meanwhile. The engine's scheduler still runs interactive work first and
        preempts batch work; this keeps batch requests from queueing ahead of the next
        interactive arrivals in the first place."""
        choice = self.choose_pool(req)
        if choice is None or self.batch_room(choice.pool):
            return
        metrics.BATCH_HELD.inc()
        t0 = last_keepalive = time.monotonic()
        if held is not None:
            held.release()
        try:
            while not self.batch_room(choice.pool):
                now = time.monotonic()
                if now - t0 >= self.cfg.batch_hold_max_s:
                    return
                if keepalive is not None and now - last_keepalive >= self.cfg.assign_timeout_s:
                    last_keepalive = now
                    await keepalive()
                await asyncio.sleep(self.cfg.sweep_interval_s)
        finally:
            if held is not None:
                await held.acquire()
            metrics.BATCH_HOLD_SECONDS.observe(time.monotonic() - t0)

    def room(self, pool: str) -> int:
        """Requests ``pool``'s workers take before the router holds the next: over every live
        worker, its capacity plus ``router.hold_queue_per_worker`` less what it holds (running,
        waiting, and assigned since its last beat). A pool with no live worker has unbounded
        room here: ``decide_waiting`` answers for it."""
        workers = self.registry.live(pool)
        if not workers:
            return sys.maxsize
        limit = self.cfg.hold_queue_per_worker
        return sum(
            max(w.beat.capacity + limit - (w.beat.running + w.beat.waiting + w.pending), 0)
            for w in workers
        )

    async def hold_while_full(
        self,
        req: GenerateRequest,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        held: asyncio.Semaphore | None = None,
    ) -> float | None:
        """Late binding: hold a new request (unacked, kept alive) while its pool has no
        ``room``, and let it go as room appears (a finished request, a worker that starts), up
        to ``router.hold_max_s``. A request placed at once would wait in one worker's queue
        however many workers start after it. Held requests count in ``router.max_pool_queue``
        (``decide``); the decision slot is given back meanwhile.

        Flow control (``services/router/flow.py``): held requests leave in fair-share order
        (band, their tenant's counter, then arrival), not arrival order; a tenant with fewer
        than ``flow.min_in_flight`` requests in the pool is not held at all; a tenant at its
        waiting bound gets ``over_share``, and a request past its queue deadline
        ``deadline_exceeded`` (raised as ``Refused``). Returns the seconds it was held, None
        when it was not."""
        choice = self.choose_pool(req)
        if choice is None or self.cfg.hold_max_s <= 0:
            return None
        pool = choice.pool
        tenant = self.flow.arrive(req, pool)
        line = self.held.setdefault(pool, [])
        if self.flow.bypass(pool, tenant) or len(line) < self.room(pool):
            return None  # room for everyone held before it and for it, or its first in flight
        queued = len(line) + sum(w.beat.waiting + w.pending for w in self.registry.live(pool))
        if queued >= self.cfg.max_pool_queue:
            return None  # ``decide`` refuses it (no_capacity)
        refused = self.flow.over_share(req, pool, tenant) or self.flow.expired(req)
        if refused is not None:
            raise Refused(refused)
        me = HeldRequest(tenant, PRIORITY_BANDS.index(req.priority), time.monotonic())
        last_keepalive = me.since
        line.append(me)
        self.flow.hold(pool, tenant, 1)
        # An arrival the planner counts now (RouterBeat.held_arrivals), not when it is placed:
        # placements while the pool is full come at the pool's pace, not the arrivals'.
        self.held_arrivals[pool] = self.held_arrivals.get(pool, 0) + 1
        metrics.HELD.labels(pool=pool).inc()
        if held is not None:
            held.release()
        try:
            while True:
                await asyncio.sleep(self.cfg.sweep_interval_s)
                now = time.monotonic()
                if self._rank(pool, me) < self.room(pool) or now - me.since >= self.cfg.hold_max_s:
                    return now - me.since
                refused = self.flow.expired(req)
                if refused is not None:
                    raise Refused(refused)
                if keepalive is not None and now - last_keepalive >= self.cfg.assign_timeout_s:
                    last_keepalive = now
                    await keepalive()
        finally:
            line[:] = [e for e in line if e is not me]
            self.flow.hold(pool, tenant, -1)
            metrics.HELD.labels(pool=pool).dec()
            metrics.HOLD_SECONDS.observe(time.monotonic() - me.since)
            if held is not None:
                await held.acquire()

    def _rank(self, pool: str, me: HeldRequest) -> int:
        """Held requests of ``pool`` that leave before ``me`` (fair-share order)."""
        key = self.flow.order(pool, me.tenant, me.band, me.since)
        return sum(
            1 for e in self.held[pool] if self.flow.order(pool, e.tenant, e.band, e.since) < key
        )

    def beat(self, router_id: str) -> RouterBeat:
        """What this router holds now, and the requests it began holding since the last beat
        (``services.router.main`` publishes it every ``router.beat_interval_s``)."""
        now = time.monotonic()
        arrived, self.held_arrivals = self.held_arrivals, {}
        return RouterBeat(
            router_id=router_id,
            held={p: len(line) for p, line in self.held.items() if line},
            waiting={p: n for p, n in self.waiting.items() if n},
            oldest_held_s={
                p: round(now - min(e.since for e in line), 3)
                for p, line in self.held.items()
                if line
            },
            held_arrivals=arrived,
        )
