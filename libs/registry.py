"""Live view of the workers, built from their beats and KV events (router and gateway).

The router's subscription callbacks call ``on_beat`` / ``on_kv_event``; placement reads
``live(pool)`` and ``overlaps(hashes)``. A worker whose last beat is older than ``ttl_s`` is not
live, and ``expire()`` drops it (with its blocks). Every router replica builds the same view from
the same subjects, so replicas agree without talking; the only per-replica state is ``pending``
(assignments this replica made that the worker's beats may not show yet).

A worker that stops beating without having said it drains (a crash, a kill) is remembered as
*lost* for ``return_wait_s``: a supervisor, the planner or Kubernetes is bringing it back, so
``returning_until`` tells the router how long a request for its pool may wait for a worker
instead of failing. For one TTL after the registry starts (a restarted router) every pool may
still have workers it simply has not heard yet. A worker that is starting announces its stage
(``WorkerStarting``, ``on_starting``) until it beats: its pool stays awaited while the
announcements keep coming and its stage has lasted no longer than ``stall_s`` (a worker that
stopped making progress is given up on; decision 0034).

Blocks are indexed twice: per worker (to forget them when the worker goes) and per hash →
holders (so the overlap of a prompt with *every* worker is one walk down its block chain).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from libs.protocol import KvEvent, WorkerBeat, WorkerStarting


@dataclass
class WorkerView:
    beat: WorkerBeat
    seen_at: float  # time.monotonic() of the last beat
    # Chain hashes of the prefix blocks this worker holds (from its KV events).
    blocks: set[int] = field(default_factory=set)
    # time.monotonic() of assignments this router made that the last beat may not count yet.
    pending_at: list[float] = field(default_factory=list)
    # time.monotonic() of this incarnation's first beat (a restarted worker is a new one).
    joined_at: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.beat.worker_id

    @property
    def pending(self) -> int:
        return len(self.pending_at)

    @property
    def load(self) -> float:
        """Decode load: sequences held (running + waiting + pending) over the worker's
        capacity, or its decode rows' step time over its ITL target when that is higher."""
        return held_load(self.beat, len(self.pending_at))


def held_load(b: WorkerBeat, pending: int) -> float:
    """:attr:`WorkerView.load` of a beat and the assignments it may not count yet."""
    return max((b.running + b.waiting + pending) / max(b.capacity, 1), b.step_load)


@dataclass
class StartingView:
    """A starting worker's last announcement and when it came (time.monotonic())."""

    announced: WorkerStarting
    seen_at: float


class WorkerRegistry:
    def __init__(self, ttl_s: float, return_wait_s: float = 0.0, stall_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.return_wait_s = return_wait_s
        self.stall_s = stall_s
        # worker id → its last WorkerStarting, until it beats (or falls silent for a TTL).
        self.starting: dict[str, StartingView] = {}
        self.started_at = time.monotonic()
        # worker id → (pool, time.monotonic() it stopped beating) for workers lost without
        # draining, kept ``return_wait_s``.
        self.lost: dict[str, tuple[str, float]] = {}
        self.workers: dict[str, WorkerView] = {}
        # block hash → ids of the workers that hold it
        self.holders: dict[int, set[str]] = {}
        # pool → the model its workers last reported (pools stay known after their workers go)
        self.pool_model: dict[str, str] = {}

    def on_beat(self, beat: WorkerBeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.pool_model[beat.pool] = beat.model
        self.starting.pop(beat.worker_id, None)
        view = self.workers.get(beat.worker_id)
        if view is None:
            self.workers[beat.worker_id] = WorkerView(beat=beat, seen_at=now, joined_at=now)
            self.lost.pop(beat.worker_id, None)
            return
        # NOTE: an assignment made before the previous beat arrived has had a whole beat period
        # to show up in running/waiting; later ones may not be counted yet, so they stay.
        prev = view.seen_at
        view.pending_at = [t for t in view.pending_at if t > prev]
        view.beat, view.seen_at = beat, now

    def on_starting(self, ann: WorkerStarting, now: float | None = None) -> None:
        """A starting worker's announcement. A standby's ("standby") says it will not come by
        itself: it is forgotten."""
        now = time.monotonic() if now is None else now
        if ann.stage == "standby":
            self.starting.pop(ann.worker_id, None)
        else:
            self.starting[ann.worker_id] = StartingView(ann, now)

    def progressing(self, view: StartingView, now: float) -> bool:
        """Whether a starting worker is still coming: heard within a TTL, and in its stage no
        longer than ``stall_s`` (0: no announcement counts)."""
        return now - view.seen_at <= self.ttl_s and view.announced.stage_s <= self.stall_s

    def on_kv_event(self, ev: KvEvent) -> None:
        view = self.workers.get(ev.worker_id)
        if view is None:
            return
        wid = ev.worker_id
        if ev.cleared:
            self._forget_blocks(view)
        for h in ev.stored:
            if h not in view.blocks:
                view.blocks.add(h)
                self.holders.setdefault(h, set()).add(wid)
        for h in ev.evicted:
            if h in view.blocks:
                view.blocks.discard(h)
                self._unhold(h, wid)

    def on_assigned(self, worker_id: str, now: float | None = None) -> float:
        """Count an assignment (made or about to be offered) until beats can show it."""
        at = time.monotonic() if now is None else now
        view = self.workers.get(worker_id)
        if view is not None:
            view.pending_at.append(at)
        return at

    def on_refused(self, worker_id: str, at: float) -> None:
        """Take back the ``on_assigned`` made at ``at``: the worker did not take the work."""
        view = self.workers.get(worker_id)
        if view is not None and at in view.pending_at:
            view.pending_at.remove(at)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop workers whose last beat is older than ``ttl_s``; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [w for w, v in self.workers.items() if now - v.seen_at > self.ttl_s]
        for w in gone:
            view = self.workers.pop(w)
            self._forget_blocks(view)
            if not view.beat.draining and self.return_wait_s > 0:
                self.lost[w] = (view.beat.pool, now)
        for w, (_, at) in list(self.lost.items()):
            if now - at > self.return_wait_s:
                del self.lost[w]
        for w, v in list(self.starting.items()):
            if now - v.seen_at > self.ttl_s:
                del self.starting[w]
        return gone

    def returning_until(self, pools: list[str], now: float | None = None) -> float:
        """``time.monotonic()`` until which a worker may still come to one of ``pools`` (0.0:
        none is expected): one TTL after this registry started (no beat heard yet is not no
        worker), ``return_wait_s`` after a worker of one of them was lost without draining,
        and one TTL after the last announcement of a worker of one of them that is starting
        and making progress (``progressing``)."""
        now = time.monotonic() if now is None else now
        until = self.started_at + self.ttl_s
        lost = list(self.lost.values())
        if self.return_wait_s > 0:  # past their TTL, not yet dropped by ``expire``
            lost += [
                (v.beat.pool, v.seen_at + self.ttl_s)
                for v in self.workers.values()
                if now - v.seen_at > self.ttl_s and not v.beat.draining
            ]
        for pool, at in lost:
            if pool in pools:
                until = max(until, at + self.return_wait_s)
        for v in self.starting.values():
            if v.announced.pool in pools and self.progressing(v, now):
                until = max(until, v.seen_at + self.ttl_s)
        return until if until > now else 0.0

    def refresh(self, now: float | None = None) -> None:
        """Every known worker counts as just seen: after the router itself was cut off from
        NATS, silence said nothing about the workers; they get a whole TTL to beat again."""
        now = time.monotonic() if now is None else now
        for v in self.workers.values():
            v.seen_at = max(v.seen_at, now)

    def live(
        self,
        pool: str,
        roles: tuple[str, ...] = ("aggregated", "prefill"),
        now: float | None = None,
    ) -> list[WorkerView]:
        now = time.monotonic() if now is None else now
        return [
            v
            for v in self.workers.values()
            if v.beat.pool == pool
            and v.beat.role in roles
            and not v.beat.draining
            and now - v.seen_at <= self.ttl_s
        ]

    def overlaps(self, hashes: list[int]) -> dict[str, int]:
        """worker id → number of leading blocks of the chain ``hashes`` it holds (0: absent)."""
        out: dict[str, int] = {}
        active: set[str] | None = None
        for depth, h in enumerate(hashes, 1):
            held = self.holders.get(h)
            if not held:
                break
            active = set(held) if active is None else active & held
            if not active:
                break
            for w in active:
                out[w] = depth
        return out

    def serving_pools(self, now: float | None = None) -> set[str]:
        """Pools that can run a request now: a live aggregated worker, or (disaggregated) a
        live prefill worker and a live decode worker."""
        roles: dict[str, set[str]] = {}
        for pool in self.pools():
            for v in self.live(pool, roles=("aggregated", "prefill", "decode"), now=now):
                roles.setdefault(pool, set()).add(v.beat.role)
        return {p for p, r in roles.items() if "aggregated" in r or {"prefill", "decode"} <= r}

    def pools(self) -> set[str]:
        return {v.beat.pool for v in self.workers.values()}

    def model_pools(self) -> dict[str, str]:
        """model name → pool, for requests that name a model."""
        return {v.beat.model: v.beat.pool for v in self.workers.values()}

    def _forget_blocks(self, view: WorkerView) -> None:
        for h in view.blocks:
            self._unhold(h, view.worker_id)
        view.blocks.clear()

    def _unhold(self, h: int, worker_id: str) -> None:
        held = self.holders.get(h)
        if held is not None:
            held.discard(worker_id)
            if not held:
                del self.holders[h]
