"""The planner's decision rules: SLO arithmetic, bounds, cooldowns, the stable window,
scale-to-zero and waking; and capacity measured from finished requests."""

from __future__ import annotations

import pytest

from libs.settings import PlannerSettings, PoolPlanSettings
from services.planner.capacity import Sample, concurrency_at_slo, worker_capacity
from services.planner.decide import Bounds, Capacity, Load, RoleState, need, settle

pytestmark = pytest.mark.unit

CAP = Capacity(worker_rps=2.0, concurrency=8, service_s=4.0, source="measured")
BOUNDS = Bounds(low=1, high=6, ttft_slo_s=2.0)


def load(**kw: object) -> Load:
    base: dict[str, object] = dict(
        forecast_rps=0.0, arrival_rps=0.0, queue=0, busy=0, ttft_s=None, idle_s=0.0
    )
    base.update(kw)
    return Load(**base)  # type: ignore[arg-type]


def cfg(**kw: object) -> PlannerSettings:
    base: dict[str, object] = dict(
        scale_up_cooldown_s=5.0, scale_down_cooldown_s=30.0, scale_down_stable_s=20.0
    )
    base.update(kw)
    return PlannerSettings(**base)  # type: ignore[arg-type]


def test_forecast_sizing_is_the_fewest_workers_within_the_ttft_slo() -> None:
    # 7.5 req/s on workers of 2 req/s: more capacity in 2 s lets 4 (94% full) keep the TTFT
    # within the SLO at its quantile; in 20 s the queue may grow longer first: 5.
    fast, slow = cfg(horizon_s=2.0), cfg(horizon_s=20.0)
    assert need(load(forecast_rps=7.5), CAP, BOUNDS, 1, fast) == (4, "forecast")
    assert need(load(forecast_rps=7.5), CAP, BOUNDS, 1, slow) == (5, "forecast")
    # The utilization floor: never fewer than fill the forecast to target_utilization.
    floor = cfg(horizon_s=2.0, target_utilization=0.8)
    assert need(load(forecast_rps=7.5), CAP, BOUNDS, 1, floor) == (5, "forecast")  # 7.5 / 1.6
    # With no floor (the default) a pool may be planned over capacity at the forecast (8.5 > 4
    # x 2) when the queue that builds over a short window keeps the TTFT within the SLO...
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, fast) == (4, "forecast")
    # ...not over a long one, and not with the floor at 1.0.
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, slow) == (5, "forecast")
    full = cfg(horizon_s=2.0, target_utilization=1.0)
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, full) == (5, "forecast")


def test_a_lower_quantile_plans_fewer_workers() -> None:
    # The error budget's quantile: at the median of the predicted TTFT, 8.5 req/s fit 3 workers
    # of 2 for the 2 s window (a queue of ~5 builds: a wait of 0.8 s); at 0.95 they need 4, at
    # 0.999, 5.
    fast = cfg(horizon_s=2.0)
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, fast, quantile=0.5) == (3, "forecast")
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, fast, quantile=0.95) == (4, "forecast")
    assert need(load(forecast_rps=8.5), CAP, BOUNDS, 1, fast, quantile=0.999) == (5, "forecast")
    lo = need(load(forecast_rps=15.0), CAP, BOUNDS, 1, fast, quantile=0.3)[0]
    hi = need(load(forecast_rps=15.0), CAP, BOUNDS, 1, fast, quantile=0.95)[0]
    assert lo < hi


def test_budget_quantile_spends_the_error_budget() -> None:
    from services.planner.decide import budget_quantile

    c = cfg(slo_quantile=0.95, budget_quantile_floor=0.3, budget_spend=0.5, min_samples=10)

    def missing(n: int, of: int) -> list[bool]:
        return [True] * n + [False] * (of - n)

    # No evidence yet: the SLO's quantile.
    assert budget_quantile(missing(0, 9), c) == pytest.approx(0.95)
    # Nothing missed, or less than half the budget (1.25% < 2.5% of requests): the floor.
    assert budget_quantile(missing(0, 100), c) == pytest.approx(0.3)
    assert budget_quantile(missing(1, 80), c) == pytest.approx(0.3)
    # Three quarters of the budget (3.75%): halfway from the floor to the SLO's quantile.
    assert budget_quantile(missing(3, 80), c) == pytest.approx(0.3 + 0.65 * 0.5)
    # The whole budget (5%) or more: the SLO's quantile.
    assert budget_quantile(missing(1, 20), c) == pytest.approx(0.95)
    assert budget_quantile(missing(5, 10), c) == pytest.approx(0.95)
    # A floor at (or over) the SLO's quantile: no budget spent.
    off = cfg(slo_quantile=0.95, budget_quantile_floor=0.95, min_samples=10)
    assert budget_quantile(missing(0, 100), off) == pytest.approx(0.95)


def test_a_request_held_long_sizes_at_the_slo_quantile_whatever_the_budget() -> None:
    # 16 waiting, 15 req/s on workers of 2: at the budget's floor the queue term takes fewer
    # workers than at the SLO's quantile; once the oldest held request has waited half the SLO
    # (scale_up_urgent_fraction 0.5 x 2 s) the budget is being spent now: the SLO's quantile.
    from services.planner.decide import decision_quantile

    fast = cfg(horizon_s=2.0, bucket_s=1.0)
    calm = load(arrival_rps=15.0, forecast_rps=15.0, queue=16, oldest_wait_s=0.2)
    held = load(arrival_rps=15.0, forecast_rps=15.0, queue=16, oldest_wait_s=1.0)
    assert decision_quantile(calm, BOUNDS, fast, 0.3) == pytest.approx(0.3)
    assert decision_quantile(held, BOUNDS, fast, 0.3) == pytest.approx(0.95)
    full = need(calm, CAP, BOUNDS, 1, fast)[0]
    assert need(calm, CAP, BOUNDS, 1, fast, quantile=0.3)[0] < full


def test_requests_held_while_decided_workers_come_are_not_urgent() -> None:
    # One worker, 3 decided 0.5 s ago and not beating yet: the request held for 1.2 s (over
    # half the 2 s SLO) is what they were decided for. The decision sizes at the budget's
    # quantile (3 workers: what was decided); the same held request with the 3 serving, or
    # once they have had horizon_s to come, sizes at the SLO's quantile (5) through the
    # up-cooldown.
    from services.planner.decide import capacity_coming, decide

    c = cfg(horizon_s=2.0, bucket_s=1.0, scale_up_cooldown_s=1.0)
    held = load(arrival_rps=6.0, forecast_rps=6.0, queue=12, oldest_wait_s=1.2)
    assert capacity_coming(RoleState(target=3, last_change=10.0), 1, 10.5, c)
    assert not capacity_coming(RoleState(target=3, last_change=10.0), 3, 10.5, c)  # all serve
    assert not capacity_coming(RoleState(target=3, last_change=10.0), 1, 12.0, c)  # too long
    assert not capacity_coming(RoleState(), 1, 10.5, c)  # no decision yet

    def at(current: int, now: float) -> tuple[int, str, float]:
        state = RoleState(target=3, last_change=10.0)
        v, q = decide(held, CAP, BOUNDS, state, current, now, c, budget=0.3, window=6.0)
        return v.replicas, v.reason, q

    assert at(1, 10.5) == (3, "steady", pytest.approx(0.3))
    assert at(3, 10.5) == (5, "scale_up", pytest.approx(0.95))  # within the up-cooldown
    assert at(1, 12.0) == (5, "scale_up", pytest.approx(0.95))


def test_a_step_the_forecast_did_not_see_sizes_at_the_slo_quantile() -> None:
    from services.planner.decide import decision_quantile

    c = cfg(bucket_s=1.0, step_z=3.0)
    # 6 req/s forecast: a second of 9 is noise (1.2 sd); a second of 15 (3.7 sd) is a step.
    assert decision_quantile(load(forecast_rps=6.0, recent_rps=9.0), BOUNDS, c, 0.3) == 0.3
    assert decision_quantile(load(forecast_rps=6.0, recent_rps=15.0), BOUNDS, c, 0.3) == 0.95
    # 1.5 req/s before a burst: 15 arrivals in its first second.
    assert decision_quantile(load(forecast_rps=1.5, arrival_rps=15.0), BOUNDS, c, 0.3) == 0.95


def test_a_queue_is_served_within_the_ttft_slo() -> None:
    # 1 req/s arriving and 10 waiting: one worker leaves them waiting past the SLO when more
    # capacity takes 2 s to come; three do not.
    wanted, driver = need(load(arrival_rps=1.0, queue=10), CAP, BOUNDS, 1, cfg(horizon_s=2.0))
    assert (wanted, driver) == (3, "queue")


def test_ttft_over_slo_with_a_queue_adds_a_worker_whatever_the_arithmetic() -> None:
    generous = Capacity(100.0, 64, 1.0, "prior")  # an estimate that says one is plenty
    wanted, driver = need(load(queue=1, ttft_s=3.0), generous, BOUNDS, 2, cfg())
    assert (wanted, driver) == (3, "ttft_slo")


def test_running_requests_do_not_hold_workers_they_would_drain_from() -> None:
    # A scale-down drains: requests running on a drained worker finish there, and no arrival
    # waits behind them. 20 running with nothing arriving need no worker of their own.
    assert need(load(busy=20), CAP, BOUNDS, 3, cfg()) == (0, "idle")


def test_bounds_clamp_and_say_so() -> None:
    st = RoleState(target=6)
    v = settle(9, "forecast", load(), BOUNDS, st, 6, now=100.0, cfg=cfg())
    assert (v.replicas, v.reason) == (6, "max_bound")
    st = RoleState(target=1, last_change=-1e9, below_since=0.0)
    v = settle(0, "idle", load(), BOUNDS, st, 1, now=100.0, cfg=cfg())
    assert (v.replicas, v.driver) == (1, "min_bound")


def test_scale_up_is_immediate_then_held_by_its_cooldown() -> None:
    st, c = RoleState(target=1), cfg()
    v = settle(3, "forecast", load(), BOUNDS, st, 1, now=10.0, cfg=c)
    assert (v.replicas, v.reason) == (3, "scale_up")
    v = settle(5, "forecast", load(), BOUNDS, st, 3, now=12.0, cfg=c)
    assert (v.replicas, v.reason) == (3, "hold_up_cooldown")
    v = settle(5, "forecast", load(), BOUNDS, st, 3, now=15.5, cfg=c)
    assert (v.replicas, v.reason) == (5, "scale_up")


def test_scale_down_needs_a_stable_window_a_cooldown_and_goes_one_step() -> None:
    st, c = RoleState(target=4, last_change=0.0), cfg()
    assert settle(1, "forecast", load(), BOUNDS, st, 4, 40.0, c).reason == "hold_down_unstable"
    # A decision that wants as many as now resets the window.
    assert settle(4, "forecast", load(), BOUNDS, st, 4, 50.0, c).reason == "steady"
    assert settle(1, "forecast", load(), BOUNDS, st, 4, 55.0, c).reason == "hold_down_unstable"
    v = settle(1, "forecast", load(), BOUNDS, st, 4, 75.0, c)
    assert (v.replicas, v.reason) == (3, "scale_down")  # max_scale_down_step = 1
    # The next step waits for the cooldown after that change (the window still holds).
    assert settle(1, "forecast", load(), BOUNDS, st, 3, 90.0, c).reason == "hold_down_cooldown"
    assert settle(1, "forecast", load(), BOUNDS, st, 3, 106.0, c).replicas == 2
    # Wanting as many as the target again closes the window.
    assert settle(2, "forecast", load(), BOUNDS, st, 2, 107.0, c).reason == "steady"
    assert settle(1, "forecast", load(), BOUNDS, st, 2, 140.0, c).reason == "hold_down_unstable"


def test_scale_to_zero_only_when_allowed_and_idle_long_enough_then_wake() -> None:
    zero = Bounds(low=0, high=4, ttft_slo_s=2.0)
    c = cfg(idle_to_zero_s=60.0, scale_down_stable_s=0.0, scale_down_cooldown_s=0.0)
    st = RoleState(target=1)
    v = settle(0, "idle", load(idle_s=30.0), zero, st, 1, 100.0, c)
    assert (v.replicas, v.driver) == (1, "idle")
    v = settle(0, "idle", load(idle_s=61.0), zero, st, 1, 131.0, c)
    assert (v.replicas, v.reason) == (0, "scale_to_zero")
    v = settle(0, "idle", load(idle_s=0.0, demand_while_zero=True), zero, st, 0, 140.0, c)
    assert (v.replicas, v.reason, v.driver) == (1, "wake", "wake")
    # A pool with min_replicas >= 1 never goes to zero, however idle.
    st = RoleState(target=1)
    assert settle(0, "idle", load(idle_s=1e6), BOUNDS, st, 1, 1e6, c).replicas == 1


def test_scale_down_window_reads_the_windows_mean_load() -> None:
    # "forecast" policy: the window's mean load (down_need) decides, not every decision of it.
    st, c = RoleState(target=4, last_change=0.0), cfg()
    # The mean load still needs 4: held, whatever the decision now says.
    v = settle(1, "forecast", load(), BOUNDS, st, 4, 40.0, c, down_need=4)
    assert (v.replicas, v.reason) == (4, "hold_down_window")
    # It needs 2 and the decision now wants 1: down at once (no run of wanting fewer needed),
    # one step, never below the window's need.
    v = settle(1, "forecast", load(), BOUNDS, st, 4, 41.0, c, down_need=2)
    assert (v.replicas, v.reason) == (3, "scale_down")
    assert settle(1, "forecast", load(), BOUNDS, st, 3, 50.0, c, down_need=2).reason == (
        "hold_down_cooldown"
    )
    v = settle(1, "forecast", load(), BOUNDS, st, 3, 72.0, c, down_need=2)
    assert (v.replicas, v.reason) == (2, "scale_down")
    st.last_change = 0.0
    assert settle(1, "forecast", load(), BOUNDS, st, 2, 200.0, c, down_need=2).reason == (
        "hold_down_window"
    )
    # The decision now wanting as many as the target holds, whatever the window says.
    assert settle(2, "forecast", load(), BOUNDS, st, 2, 201.0, c, down_need=1).reason == ("steady")


def test_no_scale_down_while_requests_wait() -> None:
    st, c = RoleState(target=3, last_change=0.0), cfg()
    v = settle(1, "forecast", load(queue=14), BOUNDS, st, 3, 100.0, c, down_need=1)
    assert (v.replicas, v.reason) == (3, "hold_down_queue")
    v = settle(1, "forecast", load(queue=0), BOUNDS, st, 3, 101.0, c, down_need=1)
    assert (v.replicas, v.reason) == (2, "scale_down")


def test_first_decision_starts_from_what_runs() -> None:
    st = RoleState()
    v = settle(1, "forecast", load(), BOUNDS, st, 3, now=0.0, cfg=cfg())
    assert (v.replicas, v.reason) == (3, "hold_down_unstable")


def sample(running: float, itl: float, decode_s: float = 2.0, ttft: float = 0.1) -> Sample:
    return Sample(0.0, "w", running, itl, decode_s, ttft, ttft, 100)


def test_concurrency_at_slo_from_itl_growing_with_running() -> None:
    # itl = 0.02 + 0.01 x running: the 0.1 s SLO is crossed at 8 sequences.
    samples = [sample(n, 0.02 + 0.01 * n) for n in range(1, 13)]
    assert concurrency_at_slo(samples, 0.1, beat_capacity=64) == 8
    assert concurrency_at_slo(samples, 0.1, beat_capacity=4) == 4
    flat = [sample(n, 0.02) for n in range(1, 13)]  # the fake engine: no growth measured
    assert concurrency_at_slo(flat, 0.1, beat_capacity=16) == 16


def test_worker_capacity_prior_then_measured() -> None:
    slo = PoolPlanSettings(itl_slo_s=0.1, prior_service_s=5.0)
    prior = worker_capacity([], slo, beat_capacity=10, min_samples=3)
    assert (prior.source, prior.worker_rps) == ("prior", pytest.approx(2.0))
    samples = [sample(n, 0.02 + 0.01 * n, decode_s=1.9, ttft=0.1) for n in range(1, 13)]
    samples[-1] = sample(12, 0.14, decode_s=1.9, ttft=1.5)  # one that waited in the worker
    got = worker_capacity(samples, slo, beat_capacity=64, min_samples=3)
    # 8 sequences over (1.9 s decode + 0.1 s prefill) = 4 requests a second.
    assert got.source == "measured" and got.concurrency == 8
    assert got.worker_rps == pytest.approx(4.0)
    # A request's time on the worker before its first token is the prefill, not a wait there.
    assert got.prefill_s == pytest.approx(0.1)


def test_reactive_sizes_on_queue_depth_alone() -> None:
    from services.planner.decide import need_reactive

    # KEDA's average-value target: 33 waiting at 16 a worker is 3 workers.
    assert need_reactive(load(queue=33), 16) == (3, "queue_depth")
    assert need_reactive(load(queue=16), 16) == (1, "queue_depth")
    # No queue: nothing, whatever the forecast, the running requests or the TTFT say (the
    # bounds then hold the floor), which is what makes it late on a burst.
    quiet = load(queue=0, forecast_rps=50.0, busy=40, ttft_s=9.0, arrival_rps=20.0)
    assert need_reactive(quiet, 16) == (0, "idle")
    wanted, driver = need_reactive(quiet, 16)
    state = RoleState(target=4, last_change=0.0)
    # Then the same settle as the planner: down only after the stable window, one at a time.
    assert settle(wanted, driver, quiet, BOUNDS, state, 4, 10.0, cfg()).reason == (
        "hold_down_unstable"
    )
    v = settle(wanted, driver, quiet, BOUNDS, state, 4, 40.0, cfg())
    assert (v.replicas, v.reason) == (3, "scale_down")


def test_planner_policy_reactive_ignores_the_forecast() -> None:
    from libs.protocol import WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    def settings(policy: str) -> Settings:
        return Settings(
            pools=[PoolSettings(name="p", model="m", backend="fake")],
            planner=PlannerSettings(  # type: ignore[arg-type]
                policy=policy, bucket_s=1.0, min_history_buckets=3, reactive_queue_per_worker=4
            ),
        )

    out = {}
    for policy in ("forecast", "reactive"):
        pl = Planner(settings(policy), "t", now=0.0)
        beat = WorkerBeat(
            worker_id="w0", pool="p", role="aggregated", model="m", capacity=4, waiting=0
        )
        for sec in range(12):  # 12 s of 8 arrivals a second, nothing waiting in the worker
            pl.on_beat(beat, float(sec))
            pl._roll(float(sec))
            for _ in range(8):
                pl._arrive("p", float(sec))
        (d,) = pl.plan(12.0)
        out[policy] = (d.replicas, d.driver)
    assert out["forecast"][0] > 1 and out["forecast"][1] == "forecast"
    assert out["reactive"] == (1, "min_bound")


def test_requests_held_in_live_routers_count_as_queued() -> None:
    from libs.protocol import RouterBeat, WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(
        pools=[PoolSettings(name="p", model="m", backend="fake")],
        planner=PlannerSettings(policy="reactive", reactive_queue_per_worker=4),  # type: ignore[arg-type]
    )
    pl = Planner(s, "t", now=0.0)
    pl.on_beat(WorkerBeat(worker_id="w0", pool="p", role="aggregated", model="m", capacity=4), 9.9)
    # Two routers hold 10 (+2 waiting for a worker to come back); a third fell silent.
    pl.on_router_beat(RouterBeat(router_id="r1", held={"p": 6}, waiting={"p": 2}), 9.9)
    pl.on_router_beat(RouterBeat(router_id="r2", held={"p": 4, "other": 50}), 9.9)
    pl.on_router_beat(RouterBeat(router_id="r3", held={"p": 100}), 0.0)
    assert pl.held("p", 10.0) == 12
    (d,) = pl.plan(10.0)
    assert (d.queue, d.replicas, d.driver) == (12, 3, "queue_depth")
    pl.forget_stale(500.0, 100.0)
    assert pl.routers == {}


def test_held_arrivals_count_once_and_an_old_held_request_skips_the_up_cooldown() -> None:
    from libs.protocol import RouteDecision, RouterBeat, RouteReason, WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(
        pools=[PoolSettings(name="p", model="m", backend="fake")],
        planner=PlannerSettings(bucket_s=1.0),  # type: ignore[arg-type]
    )
    pl = Planner(s, "t", now=0.0)
    # 5 requests held in the first second: 5 arrivals then, none again when they are placed.
    pl.on_router_beat(RouterBeat(router_id="r", held={"p": 5}, held_arrivals={"p": 5}), 0.5)
    for i in range(5):
        route = RouteReason(pool="p", worker_id="w", code="auto", factors=[f"held:{i}.0"])
        pl.on_route(RouteDecision(request_id=f"h{i}", route=route), 1.5)
    pl.on_route(RouteDecision(request_id="x", route=RouteReason("p", "w", "auto")), 1.5)
    pl._roll(2.0)
    assert pl.series("p") == [5.0, 1.0]
    assert pl.oldest_wait_s("p", 2.0) == 0.0  # the beat said nothing held for long
    pl.on_beat(WorkerBeat(worker_id="w", pool="p", role="aggregated", model="m"), 2.0)
    pl.on_router_beat(RouterBeat(router_id="r", held={"p": 9}, oldest_held_s={"p": 1.2}), 2.0)
    assert pl.oldest_wait_s("p", 2.0) == 1.2

    # settle: within the up-cooldown a larger need waits, unless a held request is that old.
    state = RoleState(target=2, last_change=10.0)
    calm = settle(4, "queue", load(queue=9), BOUNDS, state, 2, 10.5, cfg())
    assert (calm.replicas, calm.reason) == (2, "hold_up_cooldown")
    late = load(queue=9, oldest_wait_s=1.0)  # half the 2 s SLO
    v = settle(4, "queue", late, BOUNDS, state, 2, 10.5, cfg())
    assert (v.replicas, v.reason) == (4, "scale_up") and "oldest_wait=1.00" in v.factors
    off = settle(6, "queue", late, BOUNDS, state, 4, 10.6, cfg(scale_up_urgent_fraction=0.0))
    assert off.reason == "hold_up_cooldown"


def test_the_queue_term_sees_a_step_within_a_tick_not_a_bucket() -> None:
    # The last complete bucket says 1 req/s; the sliding window says 8: with a queue, 8 counts.
    c = cfg(horizon_s=2.0)
    wanted, driver = need(load(arrival_rps=1.0, recent_rps=8.0, queue=2), CAP, BOUNDS, 1, c)
    assert (wanted, driver) == (4, "queue")
    assert need(load(arrival_rps=1.0, queue=2), CAP, BOUNDS, 1, c) == (2, "queue")
    # The sliding window is the rate, not the higher of it and the last bucket: a bucket of 8
    # whose arrivals the window no longer holds (1 req/s now) sizes for 1.
    fell = load(arrival_rps=8.0, recent_rps=1.0, queue=2)
    assert need(fell, CAP, BOUNDS, 1, c) == need(load(arrival_rps=1.0, queue=2), CAP, BOUNDS, 1, c)
    # Without a queue the sliding window sizes nothing (the forecast does): no noise scale-up.
    assert need(load(arrival_rps=1.0, recent_rps=8.0), CAP, BOUNDS, 1, c) == (0, "idle")


def test_the_planner_counts_arrivals_over_a_sliding_bucket() -> None:
    from libs.protocol import RouteDecision, RouteReason
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(
        pools=[PoolSettings(name="p", model="m", backend="fake")],
        planner=PlannerSettings(bucket_s=1.0),  # type: ignore[arg-type]
    )
    pl = Planner(s, "t", now=0.0)
    for i in range(6):  # six arrivals in the first half of the second bucket
        pl.on_route(RouteDecision(request_id=f"r{i}", route=RouteReason("p", "w", "auto")), 1.1)
    view = pl.pools["p"]
    assert pl.series("p") == [0.0]  # the bucket being filled is not in the series yet
    assert view.recent_rps(1.5, 1.0) == 6.0
    assert view.recent_rps(2.2, 1.0) == 0.0  # they left the window


def test_a_draining_workers_requests_keep_no_worker() -> None:
    from libs.protocol import WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(pools=[PoolSettings(name="p", model="m", backend="fake")])
    pl = Planner(s, "t", now=0.0)
    for wid, draining in (("w0", False), ("w1", True)):
        beat = WorkerBeat(
            worker_id=wid, pool="p", role="aggregated", model="m", capacity=8, running=8
        )
        beat.draining = draining
        pl.on_beat(beat, 9.9)
    # The eight finishing on the draining one would have asked for a second worker right
    # after the scale-down that drained it (the bound keeps the serving one).
    (d,) = pl.plan(10.0)
    assert (d.current, d.replicas, d.driver) == (1, 1, "min_bound")


def test_the_planner_sizes_at_the_error_budgets_quantile() -> None:
    from libs.protocol import UsageEvent, WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(
        pools=[PoolSettings(name="p", model="m", backend="fake")],
        planner=PlannerSettings(  # type: ignore[arg-type]
            bucket_s=1.0, min_samples=10, budget_window_s=100.0, budget_quantile_floor=0.3
        ),
    )

    def planned(ttft_s: float, decode_s: float = 1.9) -> str:
        pl = Planner(s, "t", now=0.0)
        beat = WorkerBeat(worker_id="w0", pool="p", role="aggregated", model="m", capacity=8)
        pl.on_beat(beat, 9.9)
        for i in range(40):  # 40 finished requests of 20 tokens: this TTFT, this decode time
            ev = UsageEvent(
                request_id=f"r{i}", pool="p", worker_id="w0", completion_tokens=20,
                ttft_s=ttft_s, total_s=ttft_s + decode_s, prompt_tokens=100,
            )  # fmt: skip
            pl.on_usage(ev, 9.9)
        (d,) = pl.plan(10.0)
        return next(f for f in d.factors if f.startswith("quantile="))

    # Every request within the 2 s SLO: the budget is unspent, the decision at the floor.
    assert planned(0.2) == "quantile=0.30"
    # Every one over it: the budget is spent, the decision at the SLO's quantile.
    assert planned(3.0) == "quantile=0.95"
    # Within the TTFT SLO but over the ITL SLO (0.1 s: 19 gaps in 3.8 s is 0.2 s): spent too.
    assert planned(0.2, decode_s=3.8) == "quantile=0.95"


def test_the_scale_down_window_is_the_mean_of_its_buckets() -> None:
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(
        pools=[PoolSettings(name="p", model="m", backend="fake")],
        planner=PlannerSettings(bucket_s=1.0, scale_down_stable_s=4.0),  # type: ignore[arg-type]
    )
    pl = Planner(s, "t", now=0.0)
    for sec, n in enumerate([9, 9, 1, 3, 5, 7]):  # buckets of 0..5 s; the window: the last 4
        for _ in range(n):
            pl._arrive("p", sec + 0.5)
        pl._roll(sec + 1.0)
    from services.planner.decide import window_rps

    assert window_rps(pl.pools["p"].counts, s.planner) == pytest.approx((1 + 3 + 5 + 7) / 4)


def test_a_decision_orders_the_roles_workers_for_a_scale_down() -> None:
    # drain_order: live, not draining workers, fewest running + waiting first (its drain ends
    # soonest), the newest first among equals; draining and silent ones are not in it.
    from libs.protocol import WorkerBeat
    from libs.settings import PoolSettings, Settings
    from services.planner.planner import Planner

    s = Settings(pools=[PoolSettings(name="p", model="m", backend="fake")])
    pl = Planner(s, "t", now=0.0)

    def beat(wid: str, now: float, running: int, waiting: int = 0, **kw: object) -> None:
        b = WorkerBeat(
            worker_id=wid,
            pool="p",
            role="aggregated",
            model="m",
            capacity=8,
            running=running,
            waiting=waiting,
            **kw,  # type: ignore[arg-type]
        )
        pl.on_beat(b, now)

    beat("old", 1.0, running=3)
    beat("busy", 2.0, running=8, waiting=2)
    beat("new", 3.0, running=3)  # as loaded as "old", seen later: drains first
    beat("idle", 4.0, running=1)
    beat("leaving", 5.0, running=0, draining=True)
    beat("gone", -100.0, running=0)  # no beat within the TTL
    for wid, r in [("old", 3), ("busy", 8), ("new", 3), ("idle", 1)]:
        beat(wid, 9.5, running=r, waiting=2 if wid == "busy" else 0)
    (d,) = pl.plan(10.0)
    assert d.drain_order == ["idle", "new", "old", "busy"]
