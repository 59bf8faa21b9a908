"""A pool as one queue: the TTFT it predicts for a request, and the fewest workers that keep it
within the SLO.

With late binding (the router holds a request while every worker of its pool is full and gives
the oldest to the first free row, decision 0026) a pool of ``n`` workers is one FIFO queue in
front of ``n x concurrency`` rows, and while every row is busy it finishes ``n x worker_rps``
requests a second. The queue in front of it is modelled as a reflected Brownian motion (the
heavy-traffic approximation of a many-server queue):

    drift     = arrivals - n x worker_rps                  (requests a second)
    variance  = arrivals + n x worker_rps                  (Poisson arrivals, exponential service)
    queue(t)  from the requests waiting now, reflected at 0

whose distribution at a time ``t`` is closed-form (Harrison, *Brownian Motion and Stochastic
Flow Systems*, 1.8):

    P(queue(t) <= x) = Phi((x - x0 - drift t) / (s sqrt t))
                       - exp(2 drift x / s^2) Phi((-x - x0 - drift t) / (s sqrt t))

For a long ``t`` and arrivals under capacity it is the stationary queue (exponential with mean
``s^2 / (2 |drift|)``, what Erlang C gives near full load); for a short ``t`` it is the queue
that builds before more capacity can come, so a pool may run near (or, briefly, over) its
capacity while the wait stays within the SLO. A request that arrives at ``t`` waits for the
queue ahead of it to be served at ``n x worker_rps``; its TTFT is that wait plus the worker's
own TTFT (prefill and first step).
"""

from __future__ import annotations

import math

from scipy.special import log_ndtr, ndtr

# Bisection steps on the queue length (the interval halves each step).
BISECT_STEPS = 60
# Most workers ``replicas_for_ttft`` tries before it gives up (an SLO no count meets).
MAX_SEARCH = 4096


def queue_cdf(x: float, x0: float, drift: float, var: float, t: float) -> float:
    """P(queue at ``t`` <= ``x``) for a reflected Brownian motion started at ``x0``."""
    if t <= 0 or var <= 0:
        return 1.0 if x >= x0 else 0.0
    s = math.sqrt(var * t)
    first = float(ndtr((x - x0 - drift * t) / s))
    # exp(2 drift x / var) x Phi(b), in logs: the exponent grows as Phi(b) vanishes.
    log_second = 2.0 * drift * x / var + float(log_ndtr((-x - x0 - drift * t) / s))
    return max(first - math.exp(min(log_second, 0.0)), 0.0)


def queue_quantile(q: float, x0: float, drift: float, var: float, t: float) -> float:
    """The ``q`` quantile of the queue at ``t`` (requests)."""
    lo, hi = 0.0, max(x0, 0.0) + abs(drift) * t + 10.0 * math.sqrt(max(var * t, 1e-12)) + 1.0
    while queue_cdf(hi, x0, drift, var, t) < q:
        hi *= 2.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2.0
        if queue_cdf(mid, x0, drift, var, t) < q:
            lo = mid
        else:
            hi = mid
    return hi


def ttft_quantile(
    arrival_rps: float,
    queue: float,
    workers: int,
    worker_rps: float,
    prefill_s: float,
    window_s: float,
    q: float,
) -> float:
    """Predicted TTFT at quantile ``q`` of a request arriving ``window_s`` from now at a pool of
    ``workers``, ``queue`` requests waiting now and ``arrival_rps`` arriving."""
    served = workers * worker_rps
    if served <= 0:
        return math.inf
    drift = arrival_rps - served
    waiting = queue_quantile(q, float(queue), drift, arrival_rps + served, window_s)
    return prefill_s + waiting / served


def replicas_for_ttft(
    arrival_rps: float,
    queue: float,
    worker_rps: float,
    prefill_s: float,
    ttft_slo_s: float,
    window_s: float,
    q: float,
) -> int:
    """The fewest workers (at least 1) whose predicted TTFT at ``q`` is within ``ttft_slo_s``;
    when the worker's own TTFT already exceeds it no count can, and the answer is the workers
    that serve the arrivals and the queue within the SLO (a fluid bound)."""
    if prefill_s >= ttft_slo_s or worker_rps <= 0:
        return max(math.ceil((arrival_rps + queue / ttft_slo_s) / max(worker_rps, 1e-9)), 1)
    for n in range(1, MAX_SEARCH + 1):
        if ttft_quantile(arrival_rps, queue, n, worker_rps, prefill_s, window_s, q) <= ttft_slo_s:
            return n
    return MAX_SEARCH
