"""Arrival-rate forecasts: a pool's arrivals per second, one value per ``planner.bucket_s``,
forecast ``steps`` buckets ahead.

Four methods (``planner.forecast_method``), the fitted ones from statsmodels:

- ``last``: the last bucket, held (the reactive baseline);
- ``ewma``: simple exponential smoothing, its weight fitted (statsmodels ``SimpleExpSmoothing``);
- ``holt``: Holt's linear trend with a damped trend (statsmodels ``Holt``): follows a ramp
  without running away with it;
- ``arima``: ARIMA(``ARIMA_ORDER``) (statsmodels ``ARIMA``), the documents' choice.

Each fit reads at most the last ``FIT_WINDOW`` buckets. Below ``min_history`` buckets, or when a
fit fails, the forecast is the recent mean. Forecasts are never negative.
``backtest`` measures a method's error on a series the way the planner uses it (rolling origin:
fit on the past only, compare with what came); bench/planner_forecast.py runs it on the traces.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Method = Literal["holt", "arima", "ewma", "last"]
METHODS: tuple[Method, ...] = ("last", "ewma", "holt", "arima")
# Buckets a fit reads (the most recent); older history adds fit time, not accuracy, at the
# planner's horizon of minutes.
FIT_WINDOW = 120
# Buckets averaged when there is too little history to fit (and when a fit fails).
RECENT_MEAN_BUCKETS = 3
# (p, d, q): one difference for level changes, two autoregressive terms, one moving average.
ARIMA_ORDER = (2, 1, 1)


def _recent_mean(history: np.ndarray) -> float:
    return float(history[-RECENT_MEAN_BUCKETS:].mean()) if len(history) else 0.0


def _fit_forecast(method: Method, y: np.ndarray, steps: int) -> np.ndarray:
    # statsmodels warns on every near-flat series (convergence, frequency); a bad fit shows
    # as error in the backtest, not as a warning in a service's log.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "ewma":
            from statsmodels.tsa.holtwinters import SimpleExpSmoothing

            return np.asarray(
                SimpleExpSmoothing(y, initialization_method="estimated").fit().forecast(steps)
            )
        if method == "holt":
            from statsmodels.tsa.holtwinters import Holt

            model = Holt(y, damped_trend=True, initialization_method="estimated")
            return np.asarray(model.fit().forecast(steps))
        from statsmodels.tsa.arima.model import ARIMA

        return np.asarray(ARIMA(y, order=ARIMA_ORDER).fit().forecast(steps))


def forecast(
    method: Method, history: Sequence[float], steps: int, min_history: int = 6
) -> list[float]:
    """Arrivals per second for each of the next ``steps`` buckets."""
    y = np.asarray(history[-FIT_WINDOW:], dtype=float)
    if (
        method == "last"
        or len(y) < min_history
        or float(y.max(initial=0.0)) == float(y.min(initial=0.0))
    ):
        level = float(y[-1]) if method == "last" and len(y) else _recent_mean(y)
        return [max(level, 0.0)] * steps
    try:
        out = _fit_forecast(method, y, steps)
    except (ValueError, np.linalg.LinAlgError):
        out = np.full(steps, _recent_mean(y))
    if not np.all(np.isfinite(out)):
        out = np.full(steps, _recent_mean(y))
    return [max(float(v), 0.0) for v in out]


def noise_std(history: Sequence[float]) -> float:
    """The bucket-to-bucket noise of the recent series (std of its first differences over
    sqrt 2: the spread of one bucket around a level that moves slowly): the margin a plan
    keeps above a forecast, which is a mean, since load arrives as the mean plus noise."""
    y = np.asarray(history[-FIT_WINDOW:], dtype=float)
    if len(y) < 3:
        return 0.0
    return float(np.diff(y).std() / np.sqrt(2))


@dataclass
class Backtest:
    """A method's error on one series, at one horizon, rolling origin."""

    method: str
    origins: int
    # Mean absolute error of the value ``steps`` buckets ahead, over the series' mean (WAPE).
    wape: float
    # The same for the peak over the next ``steps`` buckets, which is what the planner sizes
    # the pool for, and how often that peak was under-forecast by more than ``under_tol``.
    peak_wape: float
    peak_under: float
    # The same share for the plan's bound: the forecast's peak plus ``z`` x ``noise_std``.
    upper_under: float
    fit_ms: float  # mean seconds per forecast call, in ms


def backtest(
    method: Method,
    series: Sequence[float],
    steps: int,
    start: int,
    stride: int = 1,
    under_tol: float = 0.1,
    min_history: int = 6,
    z: float = 1.0,
) -> Backtest:
    """Forecast from every ``stride``-th origin t >= ``start`` on ``series[:t]`` and compare
    with ``series[t:t+steps]``."""
    y = np.asarray(series, dtype=float)
    scale = max(float(y.mean()), 1e-9)
    errs, peak_errs, under, upper_under, spent = [], [], 0, 0, 0.0
    origins = range(start, len(y) - steps + 1, stride)
    for t in origins:
        t0 = time.perf_counter()
        fc = forecast(method, y[:t].tolist(), steps, min_history)
        spent += time.perf_counter() - t0
        actual = y[t : t + steps]
        errs.append(abs(fc[-1] - actual[-1]))
        peak_fc, peak = max(fc), float(actual.max())
        peak_errs.append(abs(peak_fc - peak))
        under += peak_fc < peak * (1 - under_tol)
        upper_under += peak_fc + z * noise_std(y[:t].tolist()) < peak * (1 - under_tol)
    n = max(len(errs), 1)
    return Backtest(
        method=method,
        origins=len(errs),
        wape=float(np.mean(errs)) / scale if errs else 0.0,
        peak_wape=float(np.mean(peak_errs)) / scale if peak_errs else 0.0,
        peak_under=under / n,
        upper_under=upper_under / n,
        fit_ms=spent / n * 1000,
    )
