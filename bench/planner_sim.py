"""The planner's rules against a simulated pool, in simulated time: ``python -m bench.planner_sim``.

A diagnosis tool beside ``bench.autoscaling`` (the result): the same shipped traces, lead-in,
bounds, cooldowns and calibrated FAKE costs, but the fleet is a model run in simulated time, so
a trace takes a second instead of minutes and a rule can be tried on every trace before the
fleet bench measures it. What it models:

- a pool of workers of ``--slots`` rows each behind one FIFO queue (the router's late binding);
  a request takes its prompt's prefill (``per_prompt_token_s`` a token) and then its tokens, one
  a step, a step costing ``per_token_s + per_row_s x (rows - 1)`` (the FAKE engine's costs);
- the planner every ``interval_s`` on ``bucket_s`` buckets, through the real
  ``services.planner`` code (``forecast``, ``decide.need`` / ``need_reactive``, ``settle``) and
  the capacity the calibration gives (the real planner measures it: close to this);
- the actuator: a scale-up activates a warm standby that serves ``--activation-s`` later; a
  scale-down drains the worker with the fewest rows, the newest of equals (the planner's
  ``drain_order``), which counts until its last request ends.

What it leaves out: the machine (client, router and NATS time), the measured capacity's error,
the standby refill. Its figures are a model's: compare them with each other, and with the fleet
bench's only as a check of the model.
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from collections import deque
from dataclasses import dataclass, field

from bench import traces
from bench.autoscaling import (
    CALIBRATED,
    FLEET_UTILIZATION,
    TRACE_DIR,
    Sizing,
    lead_in,
    peak_and_mean,
)
from libs.settings import FakeEngineSettings, PlannerSettings
from services.planner import decide
from services.planner.capacity import quantile
from services.planner.forecast import forecast, noise_std

# Simulated seconds a tick of the pool model advances.
DT_S = 0.01


@dataclass
class Job:
    arrival: float
    prompt: int
    tokens: int
    prefill_left: float = 0.0
    tokens_left: float = 0.0
    ttft: float | None = None
    done: float | None = None


@dataclass
class Worker:
    serves_at: float  # when it beats and takes work
    draining: bool = False
    rows: list[Job] = field(default_factory=list)


@dataclass
class SimResult:
    trace: str
    policy: str
    requests: int
    within_slo: float
    ttft_p50: float
    ttft_p99: float
    worker_s: float
    peak_worker_s: float
    changes: int
    drivers: dict[str, int] = field(default_factory=dict)
    mean_quantile: float = 0.0

    @property
    def share(self) -> float:
        return self.worker_s / self.peak_worker_s


def simulate(
    items: list[traces.Arrival],
    lead: list[traces.Arrival],
    cost: FakeEngineSettings,
    cfg: PlannerSettings,
    *,
    slots: int,
    peak_n: int,
    first_n: int,
    ttft_slo_s: float,
    itl_slo_s: float,
    activation_s: float,
    warm_s: float,
    overhead_s: float = 0.0,
) -> SimResult:
    """Replay ``lead`` then ``items`` (shifted by ``warm_s``) through the pool model and the
    planner; the figures count ``items`` only."""
    sizing = Sizing.of(cost, slots, items)
    prefill_s = sum(a.prompt_tokens for a in items) / len(items) * cost.per_prompt_token_s
    cap = decide.Capacity(sizing.worker_rps, slots, sizing.service_s, "measured", prefill_s)
    bounds = decide.Bounds(1, peak_n, ttft_slo_s)
    arrivals = [Job(a.t, a.prompt_tokens, a.max_tokens) for a in lead] + [
        Job(a.t + warm_s, a.prompt_tokens, a.max_tokens) for a in items
    ]
    measured = set(range(len(lead), len(arrivals)))
    workers = [Worker(0.0) for _ in range(first_n)]
    queue: deque[Job] = deque()
    counts: deque[int] = deque(maxlen=max(int(cfg.history_s / cfg.bucket_s), 8))
    bucket_start, current_bucket = 0.0, 0
    recent: deque[float] = deque()
    finished: deque[tuple[float, float]] = deque()  # (done, client ttft) for the TTFT term
    state = decide.RoleState()
    drivers: dict[str, int] = {}
    quantiles: list[float] = []
    end = arrivals[-1].arrival + 30.0
    t, nxt, next_plan, worker_s, changes, last_arrival = 0.0, 0, 0.0, 0.0, 0, 0.0
    steps = max(round(cfg.horizon_s / cfg.bucket_s), 1)
    while t < end and (nxt < len(arrivals) or queue or any(w.rows for w in workers)):
        while nxt < len(arrivals) and arrivals[nxt].arrival <= t:
            job = arrivals[nxt]
            job.prefill_left = job.prompt * cost.per_prompt_token_s
            job.tokens_left = job.tokens
            queue.append(job)
            current_bucket += 1
            recent.append(t)
            last_arrival = t
            nxt += 1
        while t - bucket_start >= cfg.bucket_s:
            counts.append(current_bucket)
            current_bucket, bucket_start = 0, bucket_start + cfg.bucket_s
        serving = [w for w in workers if w.serves_at <= t]
        # Late binding: the oldest held request to the serving worker with the fewest rows.
        while queue:
            free = [w for w in serving if not w.draining and len(w.rows) < slots]
            if not free:
                break
            min(free, key=lambda w: len(w.rows)).rows.append(queue.popleft())
        if t >= next_plan:
            next_plan = t + cfg.interval_s
            while recent and recent[0] <= t - cfg.bucket_s:
                recent.popleft()
            while finished and finished[0][0] < t - cfg.history_s:
                finished.popleft()
            series = [c / cfg.bucket_s for c in counts]
            fc = forecast(cfg.forecast_method, series, steps, cfg.min_history_buckets)
            current = sum(1 for w in serving if not w.draining)
            load = decide.Load(
                forecast_rps=max(fc) + cfg.forecast_z * noise_std(series) if series else 0.0,
                arrival_rps=series[-1] if series else 0.0,
                recent_rps=len(recent) / cfg.bucket_s,
                queue=len(queue),
                busy=sum(len(w.rows) for w in serving if not w.draining),
                ttft_s=quantile([f[1] for f in finished], cfg.slo_quantile),
                idle_s=t - last_arrival,
                oldest_wait_s=t - queue[0].arrival if queue else 0.0,
            )
            verdict, q = decide.decide(
                load,
                cap,
                bounds,
                state,
                current,
                t,
                cfg,
                decide.budget_quantile(
                    [f[1] > ttft_slo_s for f in finished if f[0] >= t - cfg.budget_window_s],
                    cfg,
                ),
                decide.window_rps(counts, cfg),
            )
            target = verdict.replicas
            quantiles.append(q)
            if t >= warm_s:
                key = f"{verdict.driver}:{verdict.factors[0].removeprefix('need=')}"
                drivers[key] = drivers.get(key, 0) + 1
            live = [w for w in workers if not w.draining]
            if target > len(live):
                changes += 1
                workers += [Worker(t + activation_s) for _ in range(target - len(live))]
            elif target < len(live):
                changes += 1
                for w in sorted(live, key=lambda w: (len(w.rows), -w.serves_at))[
                    : len(live) - target
                ]:
                    w.draining = True
        for w in serving:
            if not w.rows:
                continue
            step = cost.per_token_s + cost.per_row_s * (len(w.rows) - 1)
            for job in w.rows:
                if job.prefill_left > 0:
                    job.prefill_left -= DT_S
                    continue
                job.tokens_left -= DT_S / step
                if job.ttft is None:
                    job.ttft = t + step - job.arrival + overhead_s
                if job.tokens_left <= 0:
                    job.done = t
                    finished.append((t, job.ttft))
            w.rows = [j for j in w.rows if j.done is None]
        workers = [w for w in workers if not (w.draining and not w.rows and w.serves_at <= t)]
        if t >= warm_s:
            worker_s += sum(1 for w in workers if w.serves_at <= t) * DT_S
        t += DT_S
    done = [arrivals[i] for i in measured]
    ttfts = sorted(j.ttft if j.ttft is not None else math.inf for j in done)

    def ok(j: Job) -> bool:
        if j.ttft is None or j.done is None or j.ttft > ttft_slo_s:
            return False
        itl = (j.done - j.arrival - j.ttft) / max(j.tokens - 1, 1)
        return itl <= itl_slo_s

    return SimResult(
        trace="",
        policy=cfg.policy,
        requests=len(done),
        within_slo=sum(ok(j) for j in done) / len(done),
        ttft_p50=ttfts[len(ttfts) // 2],
        ttft_p99=ttfts[min(int(len(ttfts) * 0.99), len(ttfts) - 1)],
        worker_s=worker_s,
        peak_worker_s=peak_n * items[-1].t,
        changes=changes,
        drivers=drivers,
        mean_quantile=sum(quantiles) / max(len(quantiles), 1),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.planner_sim", description=__doc__)
    p.add_argument("--traces", default="steady,diurnal,burst,ramp")
    p.add_argument("--policies", default="reactive,forecast")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--reactive-queue", type=int, default=8)
    p.add_argument("--horizon-s", type=float, default=2.0)
    p.add_argument("--down-stable-s", type=float, default=10.0)
    p.add_argument("--down-cooldown-s", type=float, default=4.0)
    p.add_argument("--activation-s", type=float, default=1.1, help="standby decision -> serving")
    p.add_argument("--warm-s", type=float, default=15.0)
    p.add_argument(
        "--overhead-s", type=float, default=0.0, help="added to every TTFT (client, router, NATS)"
    )
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--seeds", type=int, default=1, help="Poisson re-draws of each trace (0: file)")
    p.add_argument(
        "--set", action="append", default=[], metavar="K=V", help="a PlannerSettings field"
    )
    p.add_argument("--drivers", action="store_true", help="decisions by driver:need")
    args = p.parse_args(argv)
    cost = FakeEngineSettings(**tomllib.loads(CALIBRATED.read_text())["fake_engine"])
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    slo = PlannerSettings().default
    info_all = json.loads((TRACE_DIR / "traces.json").read_text())
    print(
        f"{'trace':8} {'policy':9} {'seed':>4} {'within':>7} {'p50':>5} {'p99':>5} "
        f"{'worker-s':>8} {'of peak':>7} {'changes':>7} {'q':>5}"
    )
    for name in [t for t in args.traces.split(",") if t]:
        info = info_all[name]
        for seed in range(max(args.seeds, 1)):
            if seed == 0:
                items = traces.load(TRACE_DIR / f"{name}.jsonl")
            else:
                items = traces.arrivals(
                    traces.TRACES[name],
                    seed=seed,
                    scale=info["scale"],
                    compress=info["compress"],
                    duration_s=info["duration_s"],
                )
            sizing = Sizing.of(cost, args.slots, items)
            peak, _ = peak_and_mean(items, args.window_s)
            peak_n = sizing.workers_for(peak, FLEET_UTILIZATION)
            first = sum(a.t < args.window_s for a in items) / args.window_s
            first_n = sizing.workers_for(first, FLEET_UTILIZATION)
            for policy in [x for x in args.policies.split(",") if x]:
                cfg = PlannerSettings(
                    policy=policy,
                    interval_s=0.5,
                    bucket_s=1.0,
                    horizon_s=args.horizon_s,
                    min_history_buckets=3,
                    scale_up_cooldown_s=1.0,
                    scale_down_stable_s=args.down_stable_s,
                    scale_down_cooldown_s=args.down_cooldown_s,
                    reactive_queue_per_worker=args.reactive_queue,
                ).model_copy(update=extra)
                r = simulate(
                    items,
                    lead_in(items, args.warm_s, args.window_s),
                    cost,
                    cfg,
                    slots=args.slots,
                    peak_n=peak_n,
                    first_n=first_n,
                    ttft_slo_s=slo.ttft_slo_s,
                    itl_slo_s=slo.itl_slo_s,
                    activation_s=args.activation_s,
                    warm_s=args.warm_s,
                    overhead_s=args.overhead_s,
                )
                r.trace = name
                print(
                    f"{name:8} {policy:9} {seed:>4} {r.within_slo:7.1%} {r.ttft_p50:5.2f} "
                    f"{r.ttft_p99:5.2f} {r.worker_s:8.0f} {r.share:7.0%} {r.changes:7d}",
                    flush=True,
                )
                if args.drivers:
                    print("   ", dict(sorted(r.drivers.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
