"""bench.autoscaling's arithmetic: fleet sizes from the calibrated costs, and what a run is
scored on (the SLO share, worker-seconds, time to full capacity on a burst)."""

from __future__ import annotations

import pytest

from bench.autoscaling import Req, Run, Sizing, summarize
from bench.traces import Arrival
from libs.protocol import WorkerBeat
from libs.settings import FakeEngineSettings, PoolPlanSettings

pytestmark = pytest.mark.unit


def test_sizing_uses_the_step_at_full_batch_and_the_prefill() -> None:
    cost = FakeEngineSettings(per_token_s=0.01, per_row_s=0.002, per_prompt_token_s=0.001)
    items = [Arrival(0.0, 100, 50), Arrival(1.0, 300, 150)]  # means: 200 prompt, 100 out
    s = Sizing.of(cost, 4, items)
    # 100 tokens x (10 ms + 3 x 2 ms) + 200 x 1 ms = 1.8 s; 4 rows -> 2.22 req/s.
    assert s.service_s == pytest.approx(1.8)
    assert s.worker_rps == pytest.approx(4 / 1.8)
    assert s.workers_for(4 / 1.8 * 0.8, 0.8) == 1  # exactly full at the utilization: one
    assert s.workers_for(5.0, 0.8) == 3
    assert s.workers_for(0.0, 0.8) == 1  # a fleet is never empty


def _beat(wid: str, draining: bool = False) -> WorkerBeat:
    return WorkerBeat(
        worker_id=wid, pool="default", role="aggregated", model="m", draining=draining
    )


def test_summary_scores_slo_worker_seconds_and_burst_catch_up() -> None:
    slo = PoolPlanSettings(ttft_slo_s=1.0, itl_slo_s=0.1)
    reqs = [
        Req(0.5, ttft=0.2, gaps=[0.05, 0.05], ok=True),  # within
        Req(1.5, ttft=1.5, gaps=[0.05], ok=True),  # TTFT over
        Req(2.5, ttft=0.2, gaps=[0.3, 0.0], ok=True),  # mean ITL 0.15 over
        Req(3.5, ttft=0.2, gaps=[], ok=False),  # not whole
    ]
    beats = [(0.1, _beat("w0")), (1.2, _beat("w0")), (2.1, _beat("w0")), (2.2, _beat("w1"))]
    beats += [(3.1, _beat("w0")), (3.2, _beat("w1", draining=True))]
    run = Run("burst", "planner", workers=2, reqs=reqs, beats=beats, ledger_ok=3)
    s = summarize(run, slo, burst=(1.0, 3.0))
    assert s["within_slo"] == 0.25
    assert s["not_whole"] == 1 and s["completed"] == 3
    # Seconds 0..3: 1 + 1 + 2 + 2 workers beating (a draining one still costs).
    assert s["worker_s"] == 6
    assert s["burst_full_after_s"] == 1  # two serving workers from second 2, burst at 1


def test_the_simulated_pool_time_shares_a_load_between_one_and_two_workers() -> None:
    """bench.planner_sim on 60 s of 1.3 workers' worth of arrivals: every request completes;
    the planner (which spends the error budget) holds fewer worker-seconds than two workers
    would, and more than the load's 1.3, and keeps the SLO on most requests."""
    import random

    from bench.planner_sim import simulate
    from libs.settings import PlannerSettings

    cost = FakeEngineSettings(per_token_s=0.01486, per_row_s=0.000757, per_prompt_token_s=0.0013)
    rng = random.Random(7)
    items, t = [], 0.0
    rate = 1.3 * Sizing.of(cost, 8, [Arrival(0.0, 144, 80)]).worker_rps
    while t < 60.0:
        t += rng.expovariate(rate)
        items.append(Arrival(t, rng.randint(32, 256), rng.randint(32, 128)))
    cfg = PlannerSettings(  # type: ignore[call-arg]
        interval_s=0.5, bucket_s=1.0, horizon_s=2.0, min_history_buckets=3,
        scale_up_cooldown_s=1.0, scale_down_stable_s=10.0, scale_down_cooldown_s=5.0,
        min_samples=10, budget_window_s=40.0,
    )  # fmt: skip
    r = simulate(
        items, [], cost, cfg, slots=8, peak_n=3, first_n=2, ttft_slo_s=2.0, itl_slo_s=0.1,
        activation_s=1.1, warm_s=0.0,
    )  # fmt: skip
    assert r.requests == len(items)
    assert 1.3 * 60 < r.worker_s < 2 * 60 and r.changes > 2
    assert r.within_slo >= 0.9
