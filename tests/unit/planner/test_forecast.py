"""The planner's forecasts on synthetic series: levels, trends, noise margins, the fallbacks,
and the backtest that picks the default method."""

from __future__ import annotations

import math
import random

import pytest

from services.planner.forecast import backtest, forecast, noise_std

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("method", ["last", "ewma", "holt", "arima"])
def test_a_constant_series_forecasts_its_level(method: str) -> None:
    fc = forecast(method, [3.0] * 40, steps=12)  # type: ignore[arg-type]
    assert fc == pytest.approx([3.0] * 12)


def test_holt_follows_a_ramp_above_its_last_value() -> None:
    ramp = [0.5 * i for i in range(60)]
    fc = forecast("holt", ramp, steps=12)
    assert fc[-1] > ramp[-1] + 1.0  # the trend goes on (damped, not flat)
    assert fc[-1] < ramp[-1] + 0.5 * 12 * 1.2  # and does not run away


@pytest.mark.parametrize("method", ["ewma", "holt", "arima"])
def test_forecasts_are_never_negative(method: str) -> None:
    falling = [max(20.0 - i, 0.0) for i in range(30)]
    assert min(forecast(method, falling, steps=20)) >= 0.0  # type: ignore[arg-type]


def test_short_history_is_the_recent_mean() -> None:
    assert forecast("holt", [1.0, 2.0, 6.0], steps=3, min_history=6) == [3.0, 3.0, 3.0]
    assert forecast("holt", [], steps=2) == [0.0, 0.0]


def test_noise_std_measures_bucket_scatter_not_the_trend() -> None:
    rng = random.Random(0)
    trend = [0.2 * i for i in range(100)]
    noisy = [x + rng.gauss(0, 1.0) for x in trend]
    assert noise_std(trend) == pytest.approx(0.0, abs=1e-9)
    assert 0.7 < noise_std(noisy) < 1.3


def test_backtest_ranks_a_trend_model_over_the_last_value_on_a_noisy_ramp() -> None:
    rng = random.Random(1)
    series = [max(0.1 * i + rng.gauss(0, 0.8), 0.0) for i in range(160)]
    holt = backtest("holt", series, steps=12, start=20, stride=4)
    last = backtest("last", series, steps=12, start=20, stride=4)
    assert holt.origins == last.origins > 0
    assert holt.wape < last.wape
    assert not math.isnan(holt.peak_wape)
