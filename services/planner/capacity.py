"""One worker's capacity at the pool's SLO, measured from the requests it finished.

Each finished request (a worker's ``UsageEvent``) is a ``Sample``: its inter-token latency, the
mean number of requests its worker ran meanwhile (from the worker's beats), how long it held
the worker. Over the recent samples of a pool role:

- ITL against concurrency is fitted as a line, ``itl = a + b x running`` (an engine step's cost
  grows with its rows); the concurrency at the SLO is where that line crosses
  ``itl_slo_s``, capped by the capacity the workers' beats report. A flat line (no growth
  measured, e.g. the fake engine) leaves the beats' capacity.
- A request's service time is its decode time (``total - ttft`` at the worker) plus the lower
  decile of the worker's TTFT: the prefill without the time it waited behind others (a wave
  that queued in the workers leaves most of its samples' TTFT waiting: their lower quartile
  was 0.5-0.7 s where the prefill was 25 ms, in tests/integration/
  test_planner_fleet.py).
- ``worker_rps`` = concurrency / service time: requests a second one worker serves (Little).
- ``prefill_s``: that prefill, what a request takes on a worker after its wait in the queue
  (queueing.py adds the two).

Prefill workers of a disaggregated pool finish no request of their own (the decode worker
reports it): their capacity is ``prior_prefill_tokens_per_s`` over the measured mean prompt.
Before ``min_samples`` samples the pool's priors stand in (``capacity = "prior"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from libs.settings import PoolPlanSettings
from services.planner.decide import Capacity

# Quantile of the workers' TTFT taken as a request's prefill time (the rest was waiting).
PREFILL_QUANTILE = 0.1
# Spread of running counts (max - min) below which no slope of ITL can be fitted.
MIN_RUNNING_SPREAD = 1.0


@dataclass(frozen=True, slots=True)
class Sample:
    ts: float
    worker_id: str
    running: float  # the worker's mean running requests over the request's life
    itl_s: float | None  # None for a one-token answer
    decode_s: float  # worker: last token - first token
    worker_ttft_s: float  # worker: assignment -> first token
    client_ttft_s: float  # router queue + worker TTFT
    prompt_tokens: int  # not served from a prefix cache


def quantile(values: Sequence[float], q: float) -> float | None:
    return float(np.quantile(np.asarray(values, dtype=float), q)) if values else None


def concurrency_at_slo(samples: Sequence[Sample], itl_slo_s: float, beat_capacity: int) -> int:
    """Sequences one worker runs with ITL within the SLO (at least 1, at most its capacity)."""
    pts = [(s.running, s.itl_s) for s in samples if s.itl_s is not None]
    if len(pts) < 2:
        return beat_capacity
    x = np.asarray([p[0] for p in pts])
    y = np.asarray([p[1] for p in pts])
    if float(x.max() - x.min()) < MIN_RUNNING_SPREAD:
        return beat_capacity if float(np.median(y)) <= itl_slo_s else max(int(x.mean()), 1)
    b, a = np.polyfit(x, y, 1)
    if b <= 0:
        return beat_capacity
    return int(min(max((itl_slo_s - a) / b, 1.0), beat_capacity))


def worker_capacity(
    samples: Sequence[Sample],
    slo: PoolPlanSettings,
    beat_capacity: int,
    min_samples: int,
) -> Capacity:
    """An aggregated or decode worker's capacity (see the module's docstring)."""
    cap = slo.prior_concurrency or beat_capacity or 1
    if len(samples) < min_samples:
        return Capacity(cap / slo.prior_service_s, cap, slo.prior_service_s, "prior")
    conc = concurrency_at_slo(samples, slo.itl_slo_s, cap)
    prefill = quantile([s.worker_ttft_s for s in samples], PREFILL_QUANTILE) or 0.0
    service = float(np.mean([s.decode_s for s in samples])) + prefill
    service = max(service, 1e-3)
    return Capacity(conc / service, conc, service, "measured", prefill_s=prefill)


def prefill_capacity(samples: Sequence[Sample], slo: PoolPlanSettings) -> Capacity:
    """A prefill worker's capacity: the prior tokens a second over the measured mean prompt."""
    prompt = float(np.mean([s.prompt_tokens for s in samples])) if samples else 0.0
    per_request_s = max(prompt, 1.0) / slo.prior_prefill_tokens_per_s
    return Capacity(1.0 / per_request_s, 1, per_request_s, "prior")
