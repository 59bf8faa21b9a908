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


def test_the_perfect_forecast_floor_pays_the_scale_down_rules() -> None:
    from bench.autoscaling import perfect_forecast_worker_s
    from libs.settings import PlannerSettings
    from services.planner.decide import Bounds

    cfg = PlannerSettings(
        interval_s=0.5,
        horizon_s=2.0,
        scale_up_cooldown_s=1.0,
        scale_down_stable_s=10.0,
        scale_down_cooldown_s=5.0,
    )
    # 7 req/s for 10 s needs two workers of 4 req/s, then 1 req/s one: two from the start,
    # and the second stays the 10 s stable window after the rate fell, so 40 + 10, not 20 + 20.
    got = perfect_forecast_worker_s(
        lambda t: 7.0 if t < 10 else 1.0,
        30.0,
        Sizing(service_s=2.0, worker_rps=4.0),
        prefill_s=0.1,
        cfg=cfg,
        bounds=Bounds(1, 4, 2.0),
    )
    assert got == pytest.approx(50.0)
