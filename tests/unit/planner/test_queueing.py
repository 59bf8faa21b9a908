"""The pool as one queue (services/planner/queueing.py): the queue's distribution against its
known limits, the fewest workers for the TTFT SLO against Erlang C, and what the window until
more capacity comes changes."""

from __future__ import annotations

import math

import pytest

from services.planner.queueing import queue_quantile, replicas_for_ttft, ttft_quantile

pytestmark = pytest.mark.unit


def erlang_c_workers(rate: float, slots: int, service_s: float, wait_s: float, q: float) -> int:
    """The fewest workers of ``slots`` rows each for which an M/M/c queue waits over
    ``wait_s`` with probability at most 1 - q (Erlang C, computed through Erlang B)."""
    for n in range(1, 1000):
        c, offered = n * slots, rate * service_s
        if offered >= c:
            continue
        b = 1.0
        for k in range(1, c + 1):
            b = offered * b / (k + offered * b)
        waits = c * b / (c - offered * (1 - b))
        if waits * math.exp(-(c / service_s - rate) * wait_s) <= 1 - q:
            return n
    raise AssertionError("no count")


def test_a_long_window_is_the_stationary_queue() -> None:
    # Under capacity, a reflected Brownian motion settles to an exponential queue of mean
    # variance / (2 |drift|): its q quantile is that mean x ln(1 / (1 - q)).
    mean = 11.0 / 2.0
    for q in (0.5, 0.9, 0.95):
        got = queue_quantile(q, 0.0, -1.0, 11.0, 1e5)
        assert got == pytest.approx(mean * math.log(1 / (1 - q)), rel=1e-6)


def test_a_short_window_without_noise_is_the_fluid_queue() -> None:
    # 10 waiting, served one a second faster than they arrive, 2 s later: 8 waiting.
    assert queue_quantile(0.95, 10.0, -1.0, 1e-9, 2.0) == pytest.approx(8.0, abs=1e-3)
    # Over capacity the queue grows by the excess whatever the start.
    assert queue_quantile(0.5, 0.0, 3.0, 1e-9, 4.0) == pytest.approx(12.0, abs=1e-3)


@pytest.mark.parametrize(("slots", "service_s"), [(8, 1.8), (4, 1.0), (16, 4.0)])
def test_the_stationary_count_is_erlang_cs_or_one_more(slots: int, service_s: float) -> None:
    # The diffusion ignores rows left idle, so it never plans fewer workers than Erlang C
    # (M/M/c) and, over these loads, at most one more.
    worker_rps = slots / service_s
    for i in range(1, 41):
        rate = 0.5 * i
        exact = erlang_c_workers(rate, slots, service_s, 2.0, 0.95)
        got = replicas_for_ttft(rate, 0, worker_rps, 0.0, 2.0, 1e4, 0.95)
        assert exact <= got <= exact + 1, (rate, exact, got)


def test_the_pool_runs_near_full_when_the_wait_fits_in_the_slo() -> None:
    # 2 req/s a worker, 2 s TTFT SLO: 7.5 req/s on 4 workers (94% full) when more capacity comes
    # in 2 s; a 0.8 utilization target would have 5. Over 20 s the queue may grow more: 5.
    assert replicas_for_ttft(7.5, 0, 2.0, 0.0, 2.0, 2.0, 0.95) == 4
    assert replicas_for_ttft(7.5, 0, 2.0, 0.0, 2.0, 20.0, 0.95) == 5
    # A higher quantile, a longer own TTFT on the worker, or a queue now each cost workers.
    assert replicas_for_ttft(7.5, 0, 2.0, 0.0, 2.0, 2.0, 0.999) == 5
    assert replicas_for_ttft(7.5, 0, 2.0, 1.5, 2.0, 2.0, 0.95) == 7
    assert replicas_for_ttft(7.5, 30, 2.0, 0.0, 2.0, 2.0, 0.95) == 7


def test_ttft_is_the_wait_for_the_queue_ahead_plus_the_workers_own() -> None:
    # No noise: 10 waiting, 2 workers of 2 req/s, nothing arriving: the queue 1 s from now
    # (6) is served at 4 a second: 1.5 s, plus 0.3 s on the worker.
    got = ttft_quantile(1e-12, 10, 2, 2.0, 0.3, 1.0, 0.5)
    assert got == pytest.approx(0.3 + 6 / 4, rel=0.05)


def test_an_slo_no_worker_can_meet_falls_back_to_the_fluid_count() -> None:
    # The worker's own TTFT is over the SLO: serve the arrivals and the queue within it.
    assert replicas_for_ttft(5.0, 4, 2.0, 2.5, 2.0, 2.0, 0.95) == 4  # (5 + 4 / 2) / 2
