"""Arrival traces for the planner: seeded, compressed in time, as a rate function sampled by a
Poisson process into arrival times with prompt and output lengths.

Traces (``TRACES``):

- ``steady``: a constant rate with Poisson noise;
- ``diurnal``: a day compressed into ``DIURNAL_PERIOD_S``: a sine between night and peak;
- ``burst``: a low base, then ten times it for two minutes, then the base again;
- ``ramp``: a slow linear climb from a tenth of the peak to the peak, then held.

Rates are in requests a second at ``scale`` 1; ``scale`` multiplies them (a smaller machine
replays the same shape at a lower rate); ``compress`` k plays the trace k times faster at the
same rates (a 20-minute trace in 80 s at k = 15: a burst of 2 minutes lasts 8 s). Arrival ``i``
depends only on (trace, seed, scale, compress), so two runs of a trace see the same requests.
``python -m bench.traces NAME --out FILE`` writes one as JSON lines (``t``, ``prompt_tokens``,
``max_tokens``), the format ``strait bench serve --trace FILE`` replays (:func:`load`);
bench/traces/ ships the four, compressed, as bench/autoscaling.py replays them.

No package on PyPI ships a public LLM arrival pattern (searched 2026-11-26: nothing like the
Azure LLM inference traces or BurstGPT is packaged), so none is generated from one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import BenchRequest

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
    compress: float = 1.0,
) -> list[Arrival]:
    """A non-homogeneous Poisson process by thinning: candidates at the peak rate, each kept
    with probability rate(t) / peak. With ``compress`` k, time t of the result is the trace's
    t x k (``duration_s``, when given, is in the result's time)."""
    key = f"{trace.name}:{seed}:{scale}" + (f":{compress}" if compress != 1.0 else "")
    rng = random.Random(key)
    end = trace.duration_s / compress if duration_s is None else duration_s

    def rate(t: float) -> float:
        return trace.rate(t * compress) * scale

    peak = max(rate(i * end / 1000) for i in range(1001))
    out: list[Arrival] = []
    t = 0.0
    while peak > 0:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak <= rate(t):
            out.append(Arrival(t, rng.randint(*prompt_tokens), rng.randint(*max_tokens)))
    return out


def dump(items: list[Arrival], path: Path) -> None:
    """Write arrivals as JSON lines, the format :func:`load` reads."""
    with path.open("w") as f:
        for a in items:
            row = {"t": round(a.t, 4), "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens}
            f.write(json.dumps(row) + "\n")


def load(path: Path) -> list[Arrival]:
    """Read a trace file: one JSON object a line with ``t`` (seconds from the start, >= 0),
    ``prompt_tokens`` and ``max_tokens`` (>= 1); blank lines are skipped. Arrivals come back
    in time order. A bad line is a ``ValueError`` naming its line number."""
    out: list[Arrival] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            a = Arrival(float(row["t"]), int(row["prompt_tokens"]), int(row["max_tokens"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a trace row ({exc})") from None
        if a.t < 0 or a.prompt_tokens < 1 or a.max_tokens < 1:
            raise ValueError(f"{path}:{n}: t must be >= 0 and token counts >= 1")
        out.append(a)
    return sorted(out, key=lambda a: a.t)


# Words a replayed request's prompt is drawn from (one word is one token for the FAKE engine's
# tokenizer; a real tokenizer makes ~1.3 tokens of each).
PROMPT_WORDS = (
    "river bridge light quiet engine token narrow strait open water ship morning tide harbour "
    "cargo lantern signal current valley stone field village evening"
).split()


def bench_requests(items: list[Arrival], seed: int = 0) -> list[BenchRequest]:
    """One ``bench.serve`` request per arrival: a prompt of ``prompt_tokens`` words (its
    first words name the request, so no two share a cached prefix) and its ``max_tokens``."""
    out = []
    for i, a in enumerate(items):
        rng = random.Random(f"trace-prompt:{seed}:{i}")
        head = f"Request {i}:".split()
        body = [rng.choice(PROMPT_WORDS) for _ in range(max(a.prompt_tokens - len(head), 0))]
        out.append(BenchRequest(i, "trace", None, " ".join([*head, *body]), a.max_tokens))
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
    p.add_argument("--compress", type=float, default=1.0, help="play k times faster")
    p.add_argument("--duration", type=float, help="seconds of the result (default: all)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    trace = TRACES[args.name]
    dump(
        arrivals(trace, args.seed, args.scale, duration_s=args.duration, compress=args.compress),
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
