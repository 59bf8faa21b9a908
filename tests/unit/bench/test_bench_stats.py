from __future__ import annotations

import math

import numpy as np
import pytest

from bench.stats import SLO, RequestTiming, goodput, meets_slo, percentile, summarize

pytestmark = pytest.mark.unit

DATA = [15.0, 20.0, 35.0, 40.0, 50.0]


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0, 15.0), (25, 20.0), (40, 29.0), (50, 35.0), (90, 46.0), (100, 50.0)],
)
def test_percentile_interpolates_linearly_between_ranks(q: float, expected: float) -> None:
    # rank = q/100 * (n-1): p40 -> rank 1.6 -> 20 + 0.6 * (35 - 20) = 29
    assert percentile(DATA, q) == pytest.approx(expected)


def test_percentile_matches_numpy_default_and_ignores_order() -> None:
    values = [float(v) for v in np.random.default_rng(7).exponential(100.0, size=101)]
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(values[::-1], q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_one_value_and_bad_input() -> None:
    assert percentile([3.0], 99.9) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(DATA, 101)
    with pytest.raises(ValueError):
        percentile([1.0, math.nan], 50)


def test_summarize_reports_the_standard_percentiles() -> None:
    summary = summarize([1.0, 2.0, 3.0, 4.0])
    assert summary.to_dict() == {
        "count": 4,
        "mean": 2.5,
        "min": 1.0,
        "max": 4.0,
        "p50": 2.5,
        "p90": pytest.approx(3.7),
        "p99": pytest.approx(3.97),
        "p99_9": pytest.approx(3.997),
    }
    assert summary.get(99.9) == pytest.approx(3.997)
    empty = summarize([])
    assert empty.count == 0 and empty.mean is None and empty.get(50) is None


def _req(ok: bool = True, ttft: float | None = 0.1, itl: float | None = 0.02, e2e=1.0):
    return RequestTiming(ok=ok, ttft_s=ttft, mean_itl_s=itl, e2e_s=e2e)


def test_goodput_counts_requests_meeting_every_given_slo() -> None:
    slo = SLO(ttft_s=0.2, itl_s=0.05, e2e_s=2.0)
    requests = [
        _req(),  # meets all
        _req(ttft=0.3),  # TTFT too slow
        _req(itl=0.06),  # stream too slow
        _req(e2e=2.5),  # too long overall
        _req(ok=False),  # failed requests never count
        _req(itl=None),  # a single-token answer has no ITL to violate
    ]
    result = goodput(requests, slo, duration_s=4.0)
    assert (result.met, result.total) == (2, 6)
    assert result.fraction == pytest.approx(2 / 6)
    assert result.rate_per_s == pytest.approx(0.5)


def test_goodput_without_slo_is_the_success_rate_and_no_first_token_fails_ttft() -> None:
    requests = [_req(), _req(ok=False), _req(ttft=None)]
    assert goodput(requests, SLO(), duration_s=1.0).met == 2
    assert not meets_slo(_req(ttft=None), SLO(ttft_s=1.0))
    assert goodput([], SLO(), duration_s=0.0).fraction == 0.0
