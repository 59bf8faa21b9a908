"""Arrival traces for the planner: seeded, compressed in time, as a rate function sampled by a
Poisson process into arrival times with prompt and output lengths.

Traces (``TRACES``):

- ``steady``: a constant rate with Poisson noise;
- ``diurnal``: a day compressed into ``DIURNAL_PERIOD_S``: a sine between night and peak;
- ``burst``: a low base, then ten times it for two minutes, then the base again;
- ``ramp``: a slow linear climb from a tenth of the peak to the peak, then held.

Rates are in requests a second at ``scale`` 1; ``scale`` multiplies them (a smaller machine
replays the same shape at a lower rate). Arrival ``i`` depends only on (trace, seed, scale), so
two runs of a trace see the same requests. ``python -m bench.traces NAME --out FILE`` writes one
as JSON lines (``t``, ``prompt_tokens``, ``max_tokens``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DIURNAL_PERIOD_S = 600.0
BURST_FACTOR = 10.0


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float  # seconds from the trace's start
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]  # requests a second at time t, scale 1
    description: str


def _steady(t: float) -> float:
    return 4.0


def _diurnal(t: float) -> float:
    night, peak = 1.0, 8.0
    return night + (peak - night) * 0.5 * (1 - math.cos(2 * math.pi * t / DIURNAL_PERIOD_S))


def _burst(t: float) -> float:
    base = 1.0
    return base * BURST_FACTOR if 600.0 <= t < 720.0 else base


def _ramp(t: float) -> float:
    peak, start, climb_s = 10.0, 120.0, 900.0
    if t < start:
        return peak / 10
    return peak / 10 + (peak - peak / 10) * min((t - start) / climb_s, 1.0)


TRACES: dict[str, Trace] = {
    "steady": Trace("steady", 1200.0, _steady, "4 req/s, Poisson"),
    "diurnal": Trace("diurnal", 2400.0, _diurnal, "1 → 8 → 1 req/s, a 10-minute day, 4 days"),
    "burst": Trace("burst", 1200.0, _burst, "1 req/s, 10 req/s for 2 min at 10:00"),
    "ramp": Trace("ramp", 1500.0, _ramp, "1 → 10 req/s over 15 min from 2:00, then held"),
}


def arrivals(
    trace: Trace,
    seed: int = 0,
    scale: float = 1.0,
    prompt_tokens: tuple[int, int] = (32, 256),
    max_tokens: tuple[int, int] = (32, 128),
    duration_s: float | None = None,
) -> list[Arrival]:
    """A non-homogeneous Poisson process by thinning: candidates at the peak rate, each kept
    with probability rate(t) / peak."""
    rng = random.Random(f"{trace.name}:{seed}:{scale}")
    end = trace.duration_s if duration_s is None else duration_s
    peak = max(trace.rate(i * end / 1000) for i in range(1001)) * scale
    out: list[Arrival] = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak <= trace.rate(t) * scale:
            out.append(Arrival(t, rng.randint(*prompt_tokens), rng.randint(*max_tokens)))
    return out


def rate_series(items: list[Arrival], bucket_s: float, duration_s: float) -> list[float]:
    """Arrivals a second in each bucket of ``bucket_s`` (what the planner sees)."""
    n = math.ceil(duration_s / bucket_s)
    counts = [0] * n
    for a in items:
        counts[min(int(a.t // bucket_s), n - 1)] += 1
    return [c / bucket_s for c in counts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__)
    p.add_argument("name", choices=sorted(TRACES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    with args.out.open("w") as f:
        for a in arrivals(TRACES[args.name], args.seed, args.scale):
            f.write(
                json.dumps(
                    {
                        "t": round(a.t, 4),
                        "prompt_tokens": a.prompt_tokens,
                        "max_tokens": a.max_tokens,
                    }
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
