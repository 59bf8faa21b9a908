"""The planner's rules: from a pool role's load, its workers' capacity and its SLO, the workers
it needs; then bounds, cooldowns and scale-to-zero. Pure functions, no I/O.

Sizing (``need``), each term in workers of the role, the largest wins (its name is the
decision's ``driver``):

- ``forecast``: the fewest workers whose predicted TTFT at ``slo_quantile`` stays within the
  TTFT SLO (``queueing.replicas_for_ttft``: the pool as one queue, the forecast's peak over the
  horizon arriving, the requests waiting now in front, over the horizon, the time more
  capacity takes to come), and never fewer than fill the forecast to ``target_utilization``
  (0: no such floor, the default);
- ``queue``: while requests wait, the same prediction at today's arrivals: the last
  ``bucket_s`` up to now, a sliding window, so a step shows within a tick, not a bucket (the
  last complete bucket when the window saw none). Not the higher of the two: both count
  mostly the same arrivals, and the higher of two noisy counts sized for noise (the reactive
  term: what no forecast saw coming);
- ``ttft_slo``: the measured TTFT is over the SLO while requests wait: one worker more than
  now, whatever the arithmetic says (the capacity estimate is wrong).

Requests running now hold no worker of their own: a scale-down drains, so they finish where
they run, and what a new arrival waits for is the queue the model predicts. The quantile
each term sizes at is the error budget's (``budget_quantile``): ``slo_quantile`` when the pool's
recent requests spent the budget, lower (down to ``budget_quantile_floor``) while they did not,
so a pool of a few whole workers time-shares between n and n + 1 instead of holding n + 1.

``need_reactive`` is the baseline that sizes on queue depth alone (KEDA's way).

Then (``settle``): bounds (``min_bound`` / ``max_bound``); a pool allowed to reach zero
(min 0) goes there after ``idle_to_zero_s`` without an arrival, and wakes with one worker at
the first sign of demand; up is held for ``scale_up_cooldown_s`` after a change; down needs
the decision now to want fewer and the mean load of the last ``scale_down_stable_s`` to fit
fewer ("forecast" policy; "reactive": every decision of that window wanted fewer), waits
``scale_down_cooldown_s`` after a change, and removes at most ``max_scale_down_step`` workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from libs.settings import PlannerSettings
from services.planner.queueing import replicas_for_ttft

# Below this many requests a second, a forecast is no load (a fit's leftover noise).
NO_LOAD_RPS = 1e-3


@dataclass(frozen=True)
class Load:
    """One role of one pool, now."""

    forecast_rps: float  # peak over the horizon, margin included
    arrival_rps: float  # the last complete bucket
    queue: int  # requests waiting in the role's workers or held in routers (RouterBeat)
    busy: int  # requests running in them (not in draining ones): reported, sizes nothing
    ttft_s: float | None  # at the SLO quantile; None before any finished request
    idle_s: float  # seconds since the pool's last arrival
    demand_while_zero: bool = False  # a request for the pool arrived while it had no worker
    oldest_wait_s: float = 0.0  # the oldest request held in a router for the pool
    recent_rps: float = 0.0  # arrivals over the last bucket_s up to now (a sliding window)


@dataclass(frozen=True)
class Capacity:
    """What one worker of the role serves within the SLO."""

    worker_rps: float
    concurrency: int
    service_s: float
    source: str  # "measured" | "prior"
    prefill_s: float = 0.0  # a request's time on a worker before its first token (no wait)


@dataclass(frozen=True)
class Bounds:
    low: int
    high: int
    ttft_slo_s: float


@dataclass
class RoleState:
    """What the rules remember of one pool role between decisions."""

    target: int | None = None  # the last decision (None: none yet; start from what runs)
    last_change: float = -math.inf
    below_since: float | None = None  # when decisions began to want fewer than ``target``


@dataclass
class Verdict:
    replicas: int
    reason: str
    driver: str
    factors: list[str] = field(default_factory=list)


def need(
    load: Load,
    cap: Capacity,
    bounds: Bounds,
    current: int,
    cfg: PlannerSettings,
    quantile: float | None = None,
) -> tuple[int, str]:
    """Workers the load needs now and what set it (before bounds and cooldowns). ``quantile``:
    of the predicted TTFT kept within the SLO (``decision_quantile``; default
    ``slo_quantile``)."""

    def for_slo(rate: float) -> int:
        return replicas_for_ttft(
            rate,
            load.queue,
            cap.worker_rps,
            cap.prefill_s,
            bounds.ttft_slo_s,
            cfg.horizon_s,
            cfg.slo_quantile if quantile is None else quantile,
        )

    filled = cap.worker_rps * cfg.target_utilization
    terms = {
        "forecast": max(
            for_slo(load.forecast_rps),
            math.ceil(load.forecast_rps / filled - 1e-9) if filled > 0 else 0,
        )
        if load.forecast_rps > NO_LOAD_RPS
        else 0,
        "queue": for_slo(load.recent_rps or load.arrival_rps) if load.queue > 0 else 0,
        "ttft_slo": current + 1
        if load.queue > 0 and load.ttft_s is not None and load.ttft_s > bounds.ttft_slo_s
        else 0,
    }
    driver = max(terms, key=lambda k: terms[k])
    return terms[driver], driver if terms[driver] > 0 else "idle"


def budget_quantile(missed: Sequence[bool], cfg: PlannerSettings) -> float:
    """The quantile of the predicted TTFT a decision sizes at, from whether each of the pool's
    requests finished in the last ``budget_window_s`` missed its SLO (client TTFT over
    ``ttft_slo_s`` or mean ITL over ``itl_slo_s``: the SLO is both). The error budget is the
    share of requests the SLO lets miss (1 - ``slo_quantile``). Until ``budget_spend`` of it
    is spent, ``budget_quantile_floor``; from there to the whole budget, rising linearly to
    ``slo_quantile``; the budget spent, or fewer than ``min_samples`` requests (no evidence),
    ``slo_quantile``."""
    floor = min(cfg.budget_quantile_floor, cfg.slo_quantile)
    if len(missed) < cfg.min_samples or floor >= cfg.slo_quantile:
        return cfg.slo_quantile
    spent = sum(missed) / len(missed) / (1.0 - cfg.slo_quantile)  # of the budget
    tighten = min(max((spent - cfg.budget_spend) / (1.0 - cfg.budget_spend), 0.0), 1.0)
    return floor + (cfg.slo_quantile - floor) * tighten


def decision_quantile(
    load: Load,
    bounds: Bounds,
    cfg: PlannerSettings,
    budget: float,
    coming: bool = False,
) -> float:
    """The quantile a decision sizes at: the error budget's (``budget_quantile``), except that
    the budget is for the load the forecast knows: a step it did not see (``stepped``) or a
    request held for ``scale_up_urgent_fraction`` of the SLO (the budget spent now, faster than
    finished requests show it; ``urgent``) sizes at ``slo_quantile``. ``coming``: workers the
    last decision added are still on their way (``capacity_coming``)."""
    hurry = urgent(load, bounds, cfg) and not coming
    return cfg.slo_quantile if hurry or stepped(load, cfg) else budget


def urgent(load: Load, bounds: Bounds, cfg: PlannerSettings) -> bool:
    """A request held in a router has waited ``scale_up_urgent_fraction`` of the TTFT SLO: it
    misses the SLO unless capacity comes now."""
    return (
        cfg.scale_up_urgent_fraction > 0
        and load.oldest_wait_s >= cfg.scale_up_urgent_fraction * bounds.ttft_slo_s
    )


def capacity_coming(state: RoleState, current: int, now: float, cfg: PlannerSettings) -> bool:
    """The last decision's workers are not all serving yet and have had less than ``horizon_s``
    (the time more capacity takes to serve) to come: a request held now is what they were
    decided for, and it does not make the decision urgent. Without it, the requests that wait
    through a standby's activation read as urgent and size a second scale-up at
    ``slo_quantile`` over the first (measured on steady: a third worker every cycle)."""
    return (
        state.target is not None
        and current < state.target
        and now - state.last_change < cfg.horizon_s
    )


def stepped(load: Load, cfg: PlannerSettings) -> bool:
    """The arrivals of the last ``bucket_s`` are improbable under the forecast: over it by more
    than ``step_z`` of their Poisson standard deviation (a burst's first second, not a noisy
    one)."""
    expected = max(load.forecast_rps, 1.0 / cfg.bucket_s)
    sd = math.sqrt(expected / cfg.bucket_s)
    return max(load.arrival_rps, load.recent_rps) > load.forecast_rps + cfg.step_z * sd


def need_reactive(load: Load, queue_per_worker: int) -> tuple[int, str]:
    """The reactive baseline (``planner.policy = "reactive"``): workers for the queue alone,
    ``ceil(waiting / queue_per_worker)``, as an HPA sizes on KEDA's lag metric (an average
    value target): nothing for a forecast, for running requests or for a TTFT over the SLO."""
    wanted = math.ceil(load.queue / queue_per_worker) if load.queue > 0 else 0
    return wanted, "queue_depth" if wanted else "idle"


def settle(
    wanted: int,
    driver: str,
    load: Load,
    bounds: Bounds,
    state: RoleState,
    current: int,
    now: float,
    cfg: PlannerSettings,
    down_need: int | None = None,
    coming: bool = False,
) -> Verdict:
    """Bounds, scale-to-zero, cooldowns; updates ``state`` and returns the decision.

    ``down_need``: the workers the mean load of the last ``scale_down_stable_s`` needs (the
    "forecast" policy's scale-down window: noise in one decision neither holds nor makes a
    scale-down). None: the window is every decision of the last ``scale_down_stable_s``
    wanting fewer (the "reactive" policy, an HPA's stabilization window)."""
    base = state.target if state.target is not None else current
    factors = [f"need={wanted}", f"base={base}"]
    if bounds.low == 0 and wanted == 0:
        if base > 0 and load.idle_s < cfg.idle_to_zero_s:
            wanted, driver = 1, "idle"  # not idle long enough to go to zero
    if base == 0 and (load.demand_while_zero or load.arrival_rps > 0) and wanted < 1:
        wanted, driver = 1, "wake"
    clamped = min(max(wanted, bounds.low), bounds.high)
    if clamped != wanted:
        factors.append(f"unclamped={wanted}")
        driver = "min_bound" if clamped > wanted else driver
    reason_bound = "max_bound" if wanted > bounds.high else ""
    wanted = clamped

    if wanted > base:
        state.below_since = None
        hurry = urgent(load, bounds, cfg) and not coming
        if hurry:
            factors.append(f"oldest_wait={load.oldest_wait_s:.2f}")
        if base > 0 and now - state.last_change < cfg.scale_up_cooldown_s and not hurry:
            return _hold(state, base, "hold_up_cooldown", driver, factors)
        return _change(state, wanted, now, "wake" if base == 0 else "scale_up", driver, factors)
    if wanted < base:
        if state.below_since is None:
            state.below_since = now
        if load.queue > 0 and down_need is not None:
            # Requests wait: no capacity leaves while they do.
            return _hold(state, base, "hold_down_queue", driver, factors)
        if down_need is not None:
            factors.append(f"window_need={down_need}")
            if down_need >= base:
                return _hold(state, base, "hold_down_window", driver, factors)
            wanted = max(wanted, down_need)
        elif now - state.below_since < cfg.scale_down_stable_s:
            return _hold(state, base, "hold_down_unstable", driver, factors)
        if now - state.last_change < cfg.scale_down_cooldown_s:
            return _hold(state, base, "hold_down_cooldown", driver, factors)
        step = max(wanted, base - cfg.max_scale_down_step)
        reason = "scale_to_zero" if step == 0 else "scale_down"
        below_since = state.below_since  # still wanting fewer: the next step needs no new window
        verdict = _change(state, step, now, reason, driver, factors)
        state.below_since = below_since
        return verdict
    state.below_since = None
    state.target = base
    return Verdict(base, reason_bound or "steady", driver, factors)


def window_rps(counts: Sequence[int], cfg: PlannerSettings) -> float:
    """Mean arrivals a second over the scale-down window: the last ``scale_down_stable_s`` of
    complete buckets (fewer while the history is shorter)."""
    k = min(max(round(cfg.scale_down_stable_s / cfg.bucket_s), 1), len(counts))
    return sum(list(counts)[-k:]) / (k * cfg.bucket_s) if k else 0.0


def decide(
    load: Load,
    cap: Capacity,
    bounds: Bounds,
    state: RoleState,
    current: int,
    now: float,
    cfg: PlannerSettings,
    budget: float,
    window: float,
) -> tuple[Verdict, float]:
    """One decision for one pool role (the planner's, and bench/planner_sim.py's): the policy's
    need, then ``settle``; with the quantile it sized at. ``budget``: ``budget_quantile`` of
    the recent requests; ``window``: ``window_rps``."""
    coming = capacity_coming(state, current, now, cfg)
    q = decision_quantile(load, bounds, cfg, budget, coming)
    down_need = None
    if cfg.policy == "reactive":
        wanted, driver = need_reactive(load, cfg.reactive_queue_per_worker)
    else:
        wanted, driver = need(load, cap, bounds, current, cfg, q)
        # The scale-down window's mean load (noise in one decision neither holds nor makes a
        # scale-down).
        at_window = replace(load, forecast_rps=window, arrival_rps=window, recent_rps=0.0)
        down_need, _ = need(at_window, cap, bounds, current, cfg, q)
    return settle(wanted, driver, load, bounds, state, current, now, cfg, down_need, coming), q


def _hold(state: RoleState, base: int, reason: str, driver: str, factors: list[str]) -> Verdict:
    state.target = base
    return Verdict(base, reason, driver, factors)


def _change(
    state: RoleState, replicas: int, now: float, reason: str, driver: str, factors: list[str]
) -> Verdict:
    state.target = replicas
    state.last_change = now
    state.below_since = None
    return Verdict(replicas, reason, driver, factors)
