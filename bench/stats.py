"""Pure statistics for benchmark results: percentiles, summaries, goodput under an SLO.

Percentiles use linear interpolation between closest ranks (the default of numpy's
``percentile``, "type 7" in Hyndman & Fan): for ``n`` sorted values ``x[0..n-1]`` and a
percentile ``q`` in [0, 100], the rank is ``r = q / 100 * (n - 1)`` and the result is
``x[floor(r)] + (r - floor(r)) * (x[floor(r) + 1] - x[floor(r)])``. So p0 is the minimum, p100
the maximum, and p50 of an even count is the mean of the two middle values. With few samples a
high percentile (p99.9 of 100 requests) is an interpolation toward the maximum, not a
measurement of the tail; ``Summary.count`` says how much to trust it.

Nothing here does I/O or reads clocks; every function takes plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The percentiles every summary reports, and the key each gets in JSON ("p99.9" -> "p99_9").
SUMMARY_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)


def percentile_key(q: float) -> str:
    """JSON-friendly name of a percentile: 50 -> "p50", 99.9 -> "p99_9"."""
    text = f"{q:g}".replace(".", "_")
    return f"p{text}"


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The sorted values' element at rank ``int(q * n)`` (``q`` in [0, 1], clamped to the
    last), None for no values: a tail read off the samples themselves, not interpolated (the
    fleet benches' p99 of 100 requests is the 100th smallest)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


def pct(values: Iterable[float], q: float) -> float:
    """:func:`nearest_rank`, NaN for no values (the tails the fleet benches print)."""
    found = nearest_rank(values, q)
    return math.nan if found is None else found


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation (see module doc).

    Raises ``ValueError`` on an empty sequence, a NaN value or ``q`` outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    if any(math.isnan(v) for v in ordered):
        raise ValueError("percentile of a sequence holding NaN")
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + fraction * (ordered[high] - ordered[low])


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution of one metric; every field but ``count`` is ``None`` when there is no data."""

    count: int
    mean: float | None
    min: float | None
    max: float | None
    percentiles: dict[str, float | None]

    def get(self, q: float) -> float | None:
        return self.percentiles.get(percentile_key(q))

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "count": self.count,
            "mean": self.mean,
            "min": self.min,
            "max": self.max,
        }
        out.update(self.percentiles)
        return out


def summarize(values: Iterable[float], qs: Sequence[float] = SUMMARY_PERCENTILES) -> Summary:
    """Count, mean, min, max and the percentiles ``qs`` of ``values`` (may be empty)."""
    data = list(values)
    if not data:
        return Summary(0, None, None, None, {percentile_key(q): None for q in qs})
    return Summary(
        count=len(data),
        mean=math.fsum(data) / len(data),
        min=min(data),
        max=max(data),
        percentiles={percentile_key(q): percentile(data, q) for q in qs},
    )


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in seconds; ``None`` means "not constrained".

    ``itl_s`` bounds a request's *mean* inter-token gap (time per output token after the first),
    not its worst gap: one slow step is covered by the ITL percentiles, while the SLO asks
    whether the stream as a whole kept its pace.
    """

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.itl_s is None and self.e2e_s is None


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """What goodput needs to know about one request."""

    ok: bool
    ttft_s: float | None
    mean_itl_s: float | None  # None when the request produced fewer than two token chunks
    e2e_s: float | None


def meets_slo(request: RequestTiming, slo: SLO) -> bool:
    """True when ``request`` succeeded and is within every objective ``slo`` sets.

    A request with no ITL (one output chunk) trivially meets an ITL objective; a request with no
    first token cannot meet a TTFT objective.
    """
    if not request.ok:
        return False
    if slo.ttft_s is not None and (request.ttft_s is None or request.ttft_s > slo.ttft_s):
        return False
    if slo.itl_s is not None and request.mean_itl_s is not None and request.mean_itl_s > slo.itl_s:
        return False
    return not (slo.e2e_s is not None and (request.e2e_s is None or request.e2e_s > slo.e2e_s))


@dataclass(frozen=True, slots=True)
class Goodput:
    """Requests meeting the SLO: how many, which fraction of all requests, and per second."""

    met: int
    total: int
    fraction: float
    rate_per_s: float

    def to_dict(self) -> dict[str, float | int]:
        return {
            "met": self.met,
            "total": self.total,
            "fraction": self.fraction,
            "rate_per_s": self.rate_per_s,
        }


def goodput(requests: Sequence[RequestTiming], slo: SLO, duration_s: float) -> Goodput:
    """Goodput over ``requests`` (failed ones count in the total and never meet the SLO).

    With an empty SLO every successful request counts, so goodput equals the success rate.
    ``rate_per_s`` is ``met / duration_s`` (0 when the duration is not positive).
    """
    met = sum(1 for r in requests if meets_slo(r, slo))
    total = len(requests)
    return Goodput(
        met=met,
        total=total,
        fraction=met / total if total else 0.0,
        rate_per_s=met / duration_s if duration_s > 0 else 0.0,
    )
