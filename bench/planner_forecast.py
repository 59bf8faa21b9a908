"""The planner's forecast methods on the shipped traces (bench/traces.py): each method's error
at the planner's horizon, rolling origin, the way the planner uses it (fit on the past only).

    .venv/bin/python -m bench.planner_forecast                 # every trace, every method
    .venv/bin/python -m bench.planner_forecast --stride 4      # faster: every 4th origin

Columns: ``wape`` = mean |forecast - actual| of the bucket ``horizon`` ahead over the trace's
mean rate; ``peak wape`` = the same for the peak over the next ``horizon`` (what the pool is
sized for); ``peak under`` = share of origins whose peak was under-forecast by more than 10%;
``upper under`` = the same for the plan's bound (the peak plus ``planner.forecast_z`` x the
series' noise);
``ms/fit`` = time per forecast call on this machine.
"""

from __future__ import annotations

import argparse
import platform
import time

from bench.traces import TRACES, arrivals, rate_series
from libs.settings import PlannerSettings
from services.planner.forecast import METHODS, backtest


def main(argv: list[str] | None = None) -> int:
    defaults = PlannerSettings()
    p = argparse.ArgumentParser(prog="python -m bench.planner_forecast", description=__doc__)
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--bucket-s", type=float, default=defaults.bucket_s)
    p.add_argument("--horizon-s", type=float, default=defaults.horizon_s)
    p.add_argument("--stride", type=int, default=1, help="forecast from every Nth bucket")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    steps = max(round(args.horizon_s / args.bucket_s), 1)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"bucket {args.bucket_s:g} s, horizon {args.horizon_s:g} s ({steps} buckets), "
        f"stride {args.stride}, seed {args.seed}"
    )
    print("| trace | method | origins | wape | peak wape | peak under | upper under | ms/fit |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.traces.split(","):
        trace = TRACES[name]
        series = rate_series(arrivals(trace, args.seed), args.bucket_s, trace.duration_s)
        for method in args.methods.split(","):
            b = backtest(
                method,  # type: ignore[arg-type]
                series,
                steps,
                start=defaults.min_history_buckets,
                stride=args.stride,
                min_history=defaults.min_history_buckets,
                z=defaults.forecast_z,
            )
            print(
                f"| {name} | {method} | {b.origins} | {b.wape:.3f} | {b.peak_wape:.3f} | "
                f"{b.peak_under:.2f} | {b.upper_under:.2f} | {b.fit_ms:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
