"""The planner's state: what it has seen of the fleet, and one decision per pool role a tick.

    route events ──► arrivals per pool, in buckets of planner.bucket_s ──► forecast (peak + noise)
    worker beats ──► live workers per role, their running / waiting / capacity        │
    usage events ──► samples: ITL vs running, service time, TTFT ──► capacity at SLO  │
                                                                   decide.need ◄──────┘
                                                                   decide.settle ──► PlanDecision

No I/O here: services/planner/main.py feeds it from NATS and publishes what ``plan`` returns.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from libs.protocol import PlanDecision, PlanRole, RouteDecision, RouterBeat, UsageEvent, WorkerBeat
from libs.settings import PoolSettings, Settings
from services.planner import decide
from services.planner.capacity import Sample, prefill_capacity, quantile, worker_capacity
from services.planner.forecast import forecast, noise_std


@dataclass
class WorkerView:
    beat: WorkerBeat
    seen: float  # planner clock
    first_seen: float  # planner clock: its first beat here (the newest of equals drains first)
    # (time, running) of recent beats, for a finished request's mean concurrency.
    running: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class PoolView:
    """Arrivals of one pool: counts of complete buckets, and the one being filled."""

    counts: deque[int]
    bucket_start: float
    current: int = 0
    last_arrival: float = -math.inf
    demand_while_zero: bool = False
    # Arrival times (planner clock) of the last ``bucket_s``: a rate that moves every tick,
    # not once a bucket (the queue term's, so a step is seen half a bucket sooner).
    recent: deque[float] = field(default_factory=deque)

    def recent_rps(self, now: float, window_s: float) -> float:
        while self.recent and self.recent[0] <= now - window_s:
            self.recent.popleft()
        return len(self.recent) / window_s


# Beat TTLs (fleet.worker_ttl_s) after its start before the planner decides anything.
WARMUP_TTLS = 2


def drain_order(live: list[WorkerView]) -> list[str]:
    """``PlanDecision.drain_order``: the live, not draining workers, the one whose drain ends
    soonest first (fewest requests running and waiting; the newest of equals). The actuators
    take a scale-down's workers from its head."""
    serving = [w for w in live if not w.beat.draining]
    serving.sort(key=lambda w: (w.beat.running + w.beat.waiting, -w.first_seen))
    return [w.beat.worker_id for w in serving]


def roles_of(pool: PoolSettings) -> tuple[PlanRole, ...]:
    return ("prefill", "decode") if pool.mode == "disaggregated" else ("aggregated",)


class Planner:
    def __init__(self, settings: Settings, planner_id: str, now: float) -> None:
        self.settings = settings
        self.cfg = settings.planner
        self.planner_id = planner_id
        keep = max(int(self.cfg.history_s / self.cfg.bucket_s), self.cfg.min_history_buckets)
        self.pools = {
            p.name: PoolView(counts=deque(maxlen=keep), bucket_start=now) for p in settings.pools
        }
        self.workers: dict[str, WorkerView] = {}
        # router id → (its last beat, planner clock): requests held in routers are queued too.
        self.routers: dict[str, tuple[RouterBeat, float]] = {}
        self.samples: dict[tuple[str, str], deque[Sample]] = {}
        self.states: dict[tuple[str, str], decide.RoleState] = {}
        self.started = now

    # ------------------------------------------------------------ inputs

    def on_route(self, ev: RouteDecision, now: float) -> None:
        """One placed request: an arrival for its pool (and for a pool it spilled from), unless
        a router held it first (factor ``held:<s>``: counted when its RouterBeat said so)."""
        self._roll(now)
        if not any(f.startswith("held:") for f in ev.route.factors):
            self._arrive(ev.route.pool, now)
        for f in ev.route.factors:
            if f.startswith("no_live_worker:"):
                view = self.pools.get(f.split(":", 1)[1])
                if view is not None:
                    view.demand_while_zero = True
                    view.last_arrival = now

    def on_request_model(self, model: str, now: float) -> None:
        """A request seen on the requests subject naming ``model``: demand for a pool that has
        no worker, which the router cannot place (so no route event will count it)."""
        pool = self.settings.pool(model) or next(
            (p for p in self.settings.pools if p.model == model), None
        )
        if pool is not None and not self._live(pool.name, None, now):
            view = self.pools[pool.name]
            view.demand_while_zero = True
            view.last_arrival = now

    def on_beat(self, beat: WorkerBeat, now: float) -> None:
        view = self.workers.get(beat.worker_id)
        if view is None:
            view = self.workers[beat.worker_id] = WorkerView(beat, now, now)
        view.beat, view.seen = beat, now
        view.running.append((now, beat.running))

    def on_router_beat(self, beat: RouterBeat, now: float) -> None:
        self._roll(now)
        self.routers[beat.router_id] = (beat, now)
        for pool, n in beat.held_arrivals.items():
            for _ in range(n):
                self._arrive(pool, now)

    def oldest_wait_s(self, pool: str, now: float) -> float:
        """Seconds the oldest request a live router holds for ``pool`` has waited."""
        ttl = self.settings.fleet.worker_ttl_s
        return max(
            (
                b.oldest_held_s.get(pool, 0.0)
                for b, seen in self.routers.values()
                if now - seen <= ttl
            ),
            default=0.0,
        )

    def held(self, pool: str, now: float) -> int:
        """Requests the live routers hold for ``pool`` (not placed yet: every worker was full),
        and those waiting for one of its workers to come back."""
        ttl = self.settings.fleet.worker_ttl_s
        return sum(
            b.held.get(pool, 0) + b.waiting.get(pool, 0)
            for b, seen in self.routers.values()
            if now - seen <= ttl
        )

    def on_usage(self, ev: UsageEvent, now: float) -> None:
        """A worker's finished request: one capacity sample for its pool and role."""
        view = self.workers.get(ev.worker_id)
        if ev.status != "ok" or ev.ttft_s is None or view is None:
            return
        decode_s = max(ev.total_s - ev.ttft_s, 0.0)
        lived = [r for t, r in view.running if t >= now - ev.total_s]
        running = sum(lived) / len(lived) if lived else float(view.beat.running)
        itl = decode_s / (ev.completion_tokens - 1) if ev.completion_tokens > 1 else None
        key = (view.beat.pool, view.beat.role)
        samples = self.samples.setdefault(key, deque(maxlen=self.cfg.max_samples))
        samples.append(
            Sample(
                ts=now,
                worker_id=ev.worker_id,
                running=running,
                itl_s=itl,
                decode_s=decode_s,
                worker_ttft_s=ev.ttft_s,
                client_ttft_s=ev.queued_s + ev.ttft_s,
                prompt_tokens=max(ev.prompt_tokens - ev.cached_tokens, 0),
            )
        )

    # ------------------------------------------------------------ decisions

    def plan(self, now: float) -> list[PlanDecision]:
        """One decision per pool role; none until the workers' beats have had time to arrive
        (a planner that starts must not take the workers it has not heard yet for none)."""
        self._roll(now)
        if now - self.started < self.settings.fleet.worker_ttl_s * WARMUP_TTLS:
            return []
        out = []
        for pool in self.settings.pools:
            for role in roles_of(pool):
                out.append(self._decide(pool, role, now))
        return out

    def forecast_rps(self, pool: str) -> float:
        """The peak arrivals a second the pool is sized for over the horizon."""
        series = self.series(pool)
        steps = max(round(self.cfg.horizon_s / self.cfg.bucket_s), 1)
        fc = forecast(self.cfg.forecast_method, series, steps, self.cfg.min_history_buckets)
        return max(fc) + self.cfg.forecast_z * noise_std(series) if series else 0.0

    def series(self, pool: str) -> list[float]:
        return [c / self.cfg.bucket_s for c in self.pools[pool].counts]

    def _decide(self, pool: PoolSettings, role: PlanRole, now: float) -> PlanDecision:
        slo = self.cfg.for_pool(pool.name)
        live = self._live(pool.name, role, now)
        current = sum(1 for w in live if not w.beat.draining)
        samples = self._fresh_samples(pool.name, "decode" if role == "prefill" else role, now)
        beat_cap = max((w.beat.capacity for w in live), default=0)
        if role == "prefill":
            cap = prefill_capacity(samples, slo)
            bounds = decide.Bounds(
                slo.min_prefill_replicas, slo.max_prefill_replicas, slo.ttft_slo_s
            )
        else:
            cap = worker_capacity(samples, slo, beat_cap, self.cfg.min_samples)
            bounds = decide.Bounds(slo.min_replicas, slo.max_replicas, slo.ttft_slo_s)
        view = self.pools[pool.name]
        series = self.series(pool.name)
        ttft = quantile([s.client_ttft_s for s in samples], self.cfg.slo_quantile)
        itls = [s.itl_s for s in samples if s.itl_s is not None]
        load = decide.Load(
            forecast_rps=self.forecast_rps(pool.name),
            arrival_rps=series[-1] if series else 0.0,
            recent_rps=view.recent_rps(now, self.cfg.bucket_s),
            queue=sum(w.beat.waiting for w in live)
            + (self.held(pool.name, now) if role != "decode" else 0),
            # A draining worker's requests finish there: they hold no worker to come.
            busy=sum(w.beat.running for w in live if not w.beat.draining),
            ttft_s=ttft,
            idle_s=now - max(view.last_arrival, self.started),
            oldest_wait_s=self.oldest_wait_s(pool.name, now) if role != "decode" else 0.0,
            demand_while_zero=view.demand_while_zero,
        )
        view.demand_while_zero = False
        missed = [
            s.client_ttft_s > slo.ttft_slo_s or (s.itl_s is not None and s.itl_s > slo.itl_slo_s)
            for s in samples
            if now - s.ts <= self.cfg.budget_window_s
        ]
        state = self.states.setdefault((pool.name, role), decide.RoleState())
        verdict, q = decide.decide(
            load,
            cap,
            bounds,
            state,
            current,
            now,
            self.cfg,
            decide.budget_quantile(missed, self.cfg),
            decide.window_rps(view.counts, self.cfg),
        )
        return PlanDecision(
            pool=pool.name,
            role=role,
            replicas=verdict.replicas,
            current=current,
            reason=verdict.reason,
            driver=verdict.driver,
            factors=[
                *verdict.factors,
                f"concurrency={cap.concurrency}",
                f"service_s={cap.service_s:.3f}",
                f"prefill_s={cap.prefill_s:.3f}",
                f"samples={len(samples)}",
                f"quantile={q:.2f}",
                f"running={load.busy}",
            ],
            arrival_rps=round(load.arrival_rps, 3),
            forecast_rps=round(load.forecast_rps, 3),
            queue=load.queue,
            worker_rps=round(cap.worker_rps, 3),
            capacity="measured" if cap.source == "measured" else "prior",
            ttft_s=None if ttft is None else round(ttft, 4),
            itl_s=None if not itls else round(quantile(itls, self.cfg.slo_quantile) or 0.0, 4),
            planner_id=self.planner_id,
            drain_order=drain_order(live),
        )

    # ------------------------------------------------------------ helpers

    def _arrive(self, pool: str, now: float) -> None:
        view = self.pools.get(pool)
        if view is not None:
            view.current += 1
            view.last_arrival = now
            view.recent.append(now)

    def _roll(self, now: float) -> None:
        """Close every bucket that ended before ``now`` (empty ones count as zero)."""
        for view in self.pools.values():
            while now - view.bucket_start >= self.cfg.bucket_s:
                view.counts.append(view.current)
                view.current = 0
                view.bucket_start += self.cfg.bucket_s

    def _live(self, pool: str, role: str | None, now: float) -> list[WorkerView]:
        ttl = self.settings.fleet.worker_ttl_s
        return [
            w
            for w in self.workers.values()
            if w.beat.pool == pool and (role is None or w.beat.role == role) and now - w.seen <= ttl
        ]

    def _fresh_samples(self, pool: str, role: str, now: float) -> list[Sample]:
        samples = self.samples.get((pool, role))
        if not samples:
            return []
        horizon = self.cfg.history_s
        return [s for s in samples if now - s.ts <= horizon]

    def forget_stale(self, now: float, keep_s: float) -> None:
        """Drop workers not heard from for ``keep_s`` (bounded state over a long life)."""
        for wid in [w for w, v in self.workers.items() if now - v.seen > keep_s]:
            del self.workers[wid]
        for rid in [r for r, (_, seen) in self.routers.items() if now - seen > keep_s]:
            del self.routers[rid]
