"""Four ways to size a pool, each trace replayed against each: ``python -m bench.autoscaling``.

For every trace of bench/traces/ (steady, diurnal, burst, ramp; compressed in time) and every
mode, ``strait up`` starts a fleet of **FAKE**-engine workers whose costs are the real worker's
(configs/fake-calibrated.toml, measured by bench/fake_calibration.py), the trace is replayed
over NATS with ``libs.client`` (each request at its time, its prompt length and max_tokens,
ignore_eos), and the run is measured:

- ``peak``: a fixed fleet sized for the trace's peak rate (planner off);
- ``mean``: a fixed fleet sized for its mean rate (planner off);
- ``reactive``: the planner's actuator with ``planner.policy = "reactive"``: workers for the
  requests waiting, ceil(waiting / ``--reactive-queue``), as KEDA's lag trigger sizes;
- ``planner``: ``strait planner`` (forecast, queue and SLO terms), docs/planner.md.

Both scaling modes start at the fleet sized for the trace's first ``--window-s`` (as a planner
that had been running would be; one worker for every trace but steady), keep ``--standby`` warm
standby workers (so the two differ by their policy, not their start-up), and share bounds and
cooldowns. A fleet sized "for" a rate has ceil(rate / (worker_rps x ``FLEET_UTILIZATION``))
workers, worker_rps from the calibrated costs at ``--slots`` rows (``sizing``): the peak fleet,
the mean fleet, the bound of the scaling modes and the oracle, whatever the planner's settings.

Per run: TTFT p50/p99 and ITL p99 as the client saw them, the share of requests within the
pool's SLO (whole answer, TTFT <= ttft_slo_s, mean ITL <= itl_slo_s), serving worker-seconds
(beating workers, draining included; standby apart), requests not completed whole, ledger rows
(SQLite, status ok) against answers completed, and for the burst the time from the burst's
start until the pool had the workers the peak needs. A PNG per trace (docs/img/) plots workers,
target, queue, arrivals and forecast a second. The FAKE workers sleep instead of computing, so
each adds a real worker's capacity without taking a core of this machine; what the machine
bounds is the stream of tokens the client, router and NATS carry (``--scale``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sqlite3
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench import traces
from bench.stats import nearest_rank
from bench.support.up import strait_up
from libs.client import StraitClient
from libs.protocol import PlanDecision, Subjects, WorkerBeat
from libs.settings import FakeEngineSettings, NatsSettings, PlannerSettings, PoolPlanSettings
from libs.wire.nats_util import connect

ROOT = Path(__file__).resolve().parents[1]
TRACE_DIR = ROOT / "bench" / "traces"
CALIBRATED = ROOT / "configs" / "fake-calibrated.toml"
MODES = ("peak", "mean", "reactive", "planner")
# Share of a worker's capacity that a fleet sized "for" a rate fills: the comparison's yardstick
# (the peak fleet whose worker-seconds the others are measured against), fixed apart from the
# planner's own settings so that changing how the planner sizes does not move it.
FLEET_UTILIZATION = 0.8

CONFIG = """
[gateway]
auth_enabled = false
[router]
metrics_port = 0
[worker]
drain_timeout_s = 60.0
[engine]
max_num_seqs = {slots}
[fake_engine]
per_token_s = {per_token_s}
per_row_s = {per_row_s}
per_prompt_token_s = {per_prompt_token_s}
[planner]
enabled = {planner}
policy = "{policy}"
reactive_queue_per_worker = {reactive_queue}
warm_standby = {standby}
metrics_port = 0
interval_s = 0.5
bucket_s = 1.0
horizon_s = {horizon_s}
target_utilization = {utilization}
forecast_z = {forecast_z}
budget_window_s = {budget_window_s}
min_history_buckets = 3
scale_up_cooldown_s = 1.0
scale_down_cooldown_s = {down_cooldown_s}
scale_down_stable_s = {down_stable_s}
min_samples = 10
[planner.default]
min_replicas = 1
max_replicas = {max_replicas}
prior_concurrency = {slots}
prior_service_s = {service_s}
[models]
dir = "{models_dir}"
[[pools]]
name = "default"
model = "{model}"
backend = "{backend}"
workers = {workers}
"""


@dataclass(frozen=True)
class Sizing:
    service_s: float  # a request's time on a worker running ``slots`` rows
    worker_rps: float  # requests a second one worker serves at ``slots`` rows

    @classmethod
    def of(cls, cost: FakeEngineSettings, slots: int, items: list[traces.Arrival]) -> Sizing:
        tokens = sum(a.max_tokens for a in items) / len(items)
        prompt = sum(a.prompt_tokens for a in items) / len(items)
        step = cost.per_token_s + cost.per_row_s * (slots - 1)
        service = tokens * step + prompt * cost.per_prompt_token_s
        return cls(service, slots / service)

    def workers_for(self, rps: float, util: float) -> int:
        return max(math.ceil(rps / (self.worker_rps * util) - 1e-9), 1)


@dataclass
class Req:
    t: float  # scheduled, from the replay's start
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    ok: bool = False


@dataclass
class Run:
    trace: str
    mode: str
    workers: int  # fixed fleet size, or the bound of a scaling one
    reqs: list[Req] = field(default_factory=list)
    plans: list[tuple[float, PlanDecision]] = field(default_factory=list)
    beats: list[tuple[float, WorkerBeat]] = field(default_factory=list)
    ledger_ok: int = -1
    standby: int = 0
    lead_ok: int = 0  # lead-in requests completed (in the ledger too)


def oracle_worker_s(
    items: list[traces.Arrival], sizing: Sizing, util: float, window_s: float
) -> float:
    """Worker-seconds of a fleet that knew each ``window_s`` window's rate in advance and had
    exactly the workers it needs at the same sizing: the floor any sizing rule can reach
    without giving up the SLO."""
    series = traces.rate_series(items, window_s, items[-1].t)
    return sum(sizing.workers_for(r, util) for r in series) * window_s


def peak_and_mean(items: list[traces.Arrival], window_s: float) -> tuple[float, float]:
    """The trace's peak rate (highest ``window_s`` window) and mean rate."""
    end = items[-1].t
    series = traces.rate_series(items, window_s, end)
    return max(series), len(items) / end


async def replay(
    url: str,
    prefix: str,
    lead: list[traces.Arrival],
    items: list[traces.Arrival],
    run: Run,
    lead_s: float,
    settle_s: float,
) -> None:
    """Send ``lead`` (unmeasured: the load the fleet was under before the trace, so the planner
    has a history) over ``lead_s``, then ``items`` each at its time from the end of the lead,
    measured; beats and decisions are timed from the trace's start."""
    nc = await connect(NatsSettings(url=url), "bench-autoscaling")
    subjects = Subjects(prefix)
    start = time.monotonic() + 1.0
    t0 = start + lead_s

    async def on_plan(msg: Any) -> None:
        run.plans.append((time.monotonic() - t0, msgspec.json.decode(msg.data, type=PlanDecision)))

    async def on_beat(msg: Any) -> None:
        run.beats.append((time.monotonic() - t0, msgspec.json.decode(msg.data, type=WorkerBeat)))

    await nc.subscribe(subjects.plans_all, cb=on_plan)
    await nc.subscribe(subjects.beats_all, cb=on_beat)
    prompts = traces.bench_requests(lead + items)
    run.reqs = [Req(a.t) for a in items]
    lead_reqs = [Req(a.t) for a in lead]
    async with StraitClient(url, prefix=prefix, report_usage=False) as client:

        async def one(i: int, a: traces.Arrival, r: Req) -> None:
            sent = time.monotonic()
            last = sent
            try:
                async with client.generate(
                    prompts[i].user, max_tokens=a.max_tokens, ignore_eos=True
                ) as gen:
                    async for _ in gen:
                        now = time.monotonic()
                        if r.ttft is None:
                            r.ttft = now - sent
                        else:
                            r.gaps.append(now - last)
                        last = now
                    r.ok = gen.usage is not None and gen.usage.completion_tokens == a.max_tokens
            except Exception:
                r.ok = False

        tasks = []
        schedule = [(start + a.t, a, r) for a, r in zip(lead, lead_reqs, strict=True)]
        schedule += [(t0 + a.t, a, r) for a, r in zip(items, run.reqs, strict=True)]
        for i, (at, a, r) in enumerate(schedule):
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, a, r)))
        await asyncio.gather(*tasks)
    run.lead_ok = sum(r.ok for r in lead_reqs)
    await asyncio.sleep(settle_s)
    await nc.drain()


def lead_in(items: list[traces.Arrival], seconds: float, window_s: float) -> list[traces.Arrival]:
    """``seconds`` of Poisson arrivals at the trace's first ``window_s`` rate, shaped like its
    first requests: the load before the trace (empty for 0)."""
    first = [a for a in items if a.t < window_s] or items[:1]
    rate = len(first) / window_s
    rng = random.Random(f"lead:{len(items)}:{seconds}")
    out, t = [], 0.0
    while seconds > 0 and rate > 0:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        shape = first[len(out) % len(first)]
        out.append(traces.Arrival(t, shape.prompt_tokens, shape.max_tokens))
    return out


def ledger_ok(state: Path) -> int:
    """Rows with status ok in the fleet's SQLite ledger (-1: none found)."""
    for db in state.rglob("*.db"):
        try:
            with sqlite3.connect(db) as con:
                row = con.execute("select count(*) from requests where status='ok'").fetchone()
            return int(row[0])
        except sqlite3.Error:
            continue
    return -1


def run_one(
    args: argparse.Namespace,
    trace: str,
    mode: str,
    items: list[traces.Arrival],
    cost: FakeEngineSettings,
    sizing: Sizing,
    peak_n: int,
    mean_n: int,
    first_n: int,
) -> Run:
    scaling = mode in ("reactive", "planner")
    workers = {"peak": peak_n, "mean": mean_n}.get(mode, first_n)
    standby = min(args.standby, peak_n - 1) if scaling else 0
    config = CONFIG.format(
        slots=args.slots,
        per_token_s=cost.per_token_s,
        per_row_s=cost.per_row_s,
        per_prompt_token_s=cost.per_prompt_token_s,
        planner="true" if scaling else "false",
        policy="reactive" if mode == "reactive" else "forecast",
        reactive_queue=args.reactive_queue,
        standby=standby,
        horizon_s=args.horizon_s,
        utilization=args.planner_utilization or PlannerSettings().target_utilization,
        forecast_z=PlannerSettings().forecast_z if args.forecast_z is None else args.forecast_z,
        down_cooldown_s=args.down_cooldown_s,
        down_stable_s=args.down_stable_s,
        budget_window_s=args.budget_window_s,
        max_replicas=peak_n,
        service_s=round(sizing.service_s, 3),
        workers=workers,
        model=args.real or "fake-model",
        backend="engine" if args.real else "fake",
        models_dir=(ROOT / ".strait" / "models").as_posix(),
    )
    run = Run(trace, mode, workers if not scaling else peak_n, standby=standby)
    with strait_up(config, "asbench.v1", f"as-{trace}-{mode}", args.start_timeout_s) as up:
        # Let the planner's warm-up (two beat TTLs) pass before the trace starts.
        time.sleep(args.lead_s)
        lead = lead_in(items, args.warm_s, args.window_s)
        asyncio.run(replay(up.url, up.prefix, lead, items, run, args.warm_s, args.settle_s))
    run.ledger_ok = ledger_ok(up.dir / "state")
    print(f"  fleet log: {up.log}", flush=True)
    return run


def seconds(run: Run) -> list[dict[str, Any]]:
    """One row a second: arrivals, serving and draining workers, waiting, target, forecast."""
    end = int(max([r.t for r in run.reqs] + [t for t, _ in run.beats] + [0.0])) + 1
    rows = []
    for sec in range(end):
        beats = {b.worker_id: b for t, b in run.beats if sec <= t < sec + 1}
        plans = [d for t, d in run.plans if sec <= t < sec + 1]
        d = plans[-1] if plans else None
        rows.append(
            {
                "t": sec,
                "arrivals": sum(sec <= r.t < sec + 1 for r in run.reqs),
                "workers": sum(not b.draining for b in beats.values()),
                "draining": sum(b.draining for b in beats.values()),
                "waiting": sum(b.waiting for b in beats.values()),
                "target": d.replicas if d else None,
                "forecast_rps": d.forecast_rps if d else None,
            }
        )
    return rows


def summarize(run: Run, slo: PoolPlanSettings, burst: tuple[float, float] | None) -> dict[str, Any]:
    ttfts = [r.ttft for r in run.reqs if r.ttft is not None]
    gaps = [g for r in run.reqs for g in r.gaps]
    within = sum(
        r.ok
        and r.ttft is not None
        and r.ttft <= slo.ttft_slo_s
        and (not r.gaps or sum(r.gaps) / len(r.gaps) <= slo.itl_slo_s)
        for r in run.reqs
    )
    rows = seconds(run)
    replay_end = int(max(r.t for r in run.reqs)) + 1
    worker_s = sum(row["workers"] + row["draining"] for row in rows[:replay_end])
    out: dict[str, Any] = {
        "trace": run.trace,
        "mode": run.mode,
        "fleet": run.workers,
        "requests": len(run.reqs),
        "ttft_p50_s": nearest_rank(ttfts, 0.5),
        "ttft_p99_s": nearest_rank(ttfts, 0.99),
        "itl_p99_s": nearest_rank(gaps, 0.99),
        "within_slo": within / len(run.reqs),
        "worker_s": worker_s,
        "standby": run.standby,
        "not_whole": sum(not r.ok for r in run.reqs),
        "ledger_ok": run.ledger_ok,
        "completed": sum(r.ok for r in run.reqs),
        "lead_completed": run.lead_ok,
        "max_workers": max((row["workers"] for row in rows), default=0),
        "scale_downs": sum(d.reason in ("scale_down", "scale_to_zero") for _, d in run.plans),
    }
    if burst is not None:
        start = burst[0]
        full = next(
            (row["t"] for row in rows if row["t"] >= start and row["workers"] >= run.workers),
            None,
        )
        out["burst_full_after_s"] = None if full is None else full - start
    return out


def plot(trace: str, by_mode: dict[str, list[dict[str, Any]]], slots: int, out: Path) -> None:
    """One panel a mode, from its rows a second (``seconds``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in by_mode] + [m for m in by_mode if m not in MODES]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 2.3 * len(modes)), sharex=True)
    for ax, mode in zip(axes if len(modes) > 1 else [axes], modes, strict=True):
        rows = by_mode[mode]
        t = [r["t"] for r in rows]
        ax.step(t, [r["workers"] + r["draining"] for r in rows], where="post", label="workers")
        ax.step(
            t,
            [r["target"] if r["target"] is not None else float("nan") for r in rows],
            where="post",
            linestyle="--",
            label="target",
        )
        ax.plot(
            t,
            [r["waiting"] / slots for r in rows],
            color="tab:red",
            lw=0.8,
            label=f"waiting / {slots}",
        )
        ax.set_ylabel("workers")
        ax.set_title(f"{trace}: {mode}", fontsize=9, loc="left")
        ax2 = ax.twinx()
        ax2.plot(t, [r["arrivals"] for r in rows], color="tab:gray", lw=0.6, label="arrivals/s")
        ax2.plot(
            t,
            [r["forecast_rps"] if r["forecast_rps"] is not None else float("nan") for r in rows],
            color="tab:green",
            lw=0.9,
            label="forecast req/s",
        )
        ax2.set_ylabel("req/s")
        if ax is (axes[0] if len(modes) > 1 else axes):
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, ncol=5, loc="upper left")
    (axes[-1] if len(modes) > 1 else axes).set_xlabel("seconds of the replay")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| trace | mode | fleet | TTFT p50 s | TTFT p99 s | ITL p99 ms | within SLO | "
        "worker-s | vs peak | not whole | ledger ok / completed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    peak_ws = {s["trace"]: s["worker_s"] for s in summaries if s["mode"] == "peak"}
    for s in summaries:
        ref = peak_ws.get(s["trace"])
        fleet = f"{s['fleet']}" if s["mode"] in ("peak", "mean") else f"1..{s['fleet']}"
        lines.append(
            f"| {s['trace']} | {s['mode']} | {fleet} | {fmt(s['ttft_p50_s'])} | "
            f"{fmt(s['ttft_p99_s'])} | "
            f"{fmt(s['itl_p99_s'] * 1000 if s['itl_p99_s'] is not None else None, '.0f')} | "
            f"{s['within_slo']:.1%} | {s['worker_s']} | "
            f"{fmt(s['worker_s'] / ref if ref else None, '.0%')} | {s['not_whole']} | "
            f"{s['ledger_ok']} / {s['completed'] + s.get('lead_completed', 0)} |"
        )
    return "\n".join(lines)


def report(files: list[Path], slots: int, img: Path) -> int:
    """Merge result files (a later file's run of a (trace, mode) replaces an earlier one's),
    print the table and draw each trace's PNG again."""
    summaries: dict[tuple[str, str], dict[str, Any]] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for f in files:
        data = json.loads(f.read_text())
        for s in data["summaries"]:
            summaries[(s["trace"], s["mode"])] = s
            rows.setdefault(s["trace"], {})[s["mode"]] = data["seconds"][s["mode"]]
    order = sorted(summaries, key=lambda k: (k[0], MODES.index(k[1]) if k[1] in MODES else 9))
    print(table([summaries[k] for k in order]))
    img.mkdir(parents=True, exist_ok=True)
    for trace, by_mode in rows.items():
        plot(trace, by_mode, slots, img / f"autoscaling-{trace}.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.autoscaling", description=__doc__)
    p.add_argument("--traces", default="steady,diurnal,burst,ramp")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--slots", type=int, default=8, help="engine.max_num_seqs of a worker")
    p.add_argument("--standby", type=int, default=4, help="planner.warm_standby (scaling modes)")
    p.add_argument("--reactive-queue", type=int, default=8, help="waiting per worker (reactive)")
    p.add_argument(
        "--horizon-s",
        type=float,
        default=2.0,
        help="planner.horizon_s of the scaling modes: the time more capacity takes to serve, "
        "here a warm standby's activation (decision to its first beat ~1.1 s, "
        "docs/autoscaling.md) and a 0.5 s tick, rounded up",
    )
    p.add_argument(
        "--planner-utilization",
        type=float,
        default=None,
        help="planner.target_utilization of the scaling modes (default: the setting's); the "
        f"fleets are sized at {FLEET_UTILIZATION} whatever this says",
    )
    p.add_argument(
        "--forecast-z", type=float, default=None, help="planner.forecast_z (default: the setting's)"
    )
    p.add_argument(
        "--down-stable-s",
        type=float,
        default=10.0,
        help="planner.scale_down_stable_s (longer than the default 60 s compressed 15x: a "
        "4 s window holds too few arrivals to average)",
    )
    p.add_argument(
        "--budget-window-s",
        type=float,
        default=40.0,
        help="planner.budget_window_s (the default 600 s compressed 15x as the traces are)",
    )
    p.add_argument(
        "--down-cooldown-s",
        type=float,
        default=4.0,
        help="planner.scale_down_cooldown_s (the default 60 s compressed 15x)",
    )
    p.add_argument("--window-s", type=float, default=5.0, help="window of the peak rate")
    p.add_argument("--lead-s", type=float, default=4.0, help="seconds between ready and replay")
    p.add_argument(
        "--warm-s",
        type=float,
        default=15.0,
        help="seconds of unmeasured load at the trace's first rate before it (the planner's "
        "history: a planner that had been running)",
    )
    p.add_argument("--settle-s", type=float, default=3.0, help="seconds after the last answer")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument(
        "--real",
        metavar="MODEL",
        help="real workers of MODEL (engine backend, compile off) instead of FAKE ones, on a ramp "
        "made for them (--real-scale, --real-max-tokens); the sizing still uses the calibration",
    )
    p.add_argument(
        "--max-workers", type=int, default=0, help="bound of the scaling modes (0: peak)"
    )
    p.add_argument("--real-scale", type=float, default=0.2, help="rate scale of the real ramp")
    p.add_argument("--real-max-tokens", default="16,64", help="max_tokens range of the real ramp")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    p.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="no runs: merge these result files (later ones win), print the table, draw the PNGs",
    )
    args = p.parse_args(argv)
    if args.report:
        return report(args.report, args.slots, args.img)
    cost = FakeEngineSettings(**tomllib.loads(CALIBRATED.read_text())["fake_engine"])
    cfg = PlannerSettings()
    slo = cfg.default
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"# {stamp}, {machine}; FAKE workers calibrated ({CALIBRATED.name}): {cost}")
    summaries, meta = [], {}
    for trace in [t for t in args.traces.split(",") if t]:
        info = json.loads((TRACE_DIR / "traces.json").read_text())[trace]
        if args.real:
            lo, hi = (int(x) for x in args.real_max_tokens.split(","))
            items = traces.arrivals(
                traces.TRACES[trace],
                scale=args.real_scale,
                compress=info["compress"],
                duration_s=info["duration_s"],
                prompt_tokens=(16, 96),
                max_tokens=(lo, hi),
            )
            trace = f"{trace}-{args.real}"
        else:
            items = traces.load(TRACE_DIR / f"{trace}.jsonl")
        sizing = Sizing.of(cost, args.slots, items)
        peak, mean = peak_and_mean(items, args.window_s)
        peak_n = sizing.workers_for(peak, FLEET_UTILIZATION)
        mean_n = sizing.workers_for(mean, FLEET_UTILIZATION)
        peak_n = args.max_workers or peak_n
        first = sum(a.t < args.window_s for a in items) / args.window_s
        first_n = sizing.workers_for(first, FLEET_UTILIZATION)
        burst = tuple(info["burst_s"]) if "burst_s" in info else None
        meta[trace] = {
            "peak_rps": peak,
            "mean_rps": mean,
            "peak_workers": peak_n,
            "mean_workers": mean_n,
            "first_workers": first_n,
            "oracle_worker_s": oracle_worker_s(items, sizing, FLEET_UTILIZATION, args.window_s),
            **asdict(sizing),
        }
        print(
            f"## {trace}: {len(items)} requests over {items[-1].t:.0f} s, peak {peak:.1f} req/s, "
            f"mean {mean:.1f} req/s; a worker serves {sizing.worker_rps:.2f} req/s at "
            f"{args.slots} rows -> peak fleet {peak_n}, mean fleet {mean_n}; the peak fleet's "
            f"worker-s: {peak_n * items[-1].t:.0f}",
            flush=True,
        )
        runs = []
        for mode in [m for m in args.modes.split(",") if m]:
            run = run_one(args, trace, mode, items, cost, sizing, peak_n, mean_n, first_n)
            runs.append(run)
            s = summarize(run, slo, burst)  # type: ignore[arg-type]
            summaries.append(s)
            print(table([s]).splitlines()[-1], json.dumps(s), flush=True)
        args.img.mkdir(parents=True, exist_ok=True)
        plot(
            trace,
            {r.mode: seconds(r) for r in runs},
            args.slots,
            args.img / f"autoscaling-{trace}.png",
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"autoscaling-{trace}.json").write_text(
            json.dumps(
                {
                    "meta": meta[trace],
                    "summaries": [s for s in summaries if s["trace"] == trace],
                    "seconds": {r.mode: seconds(r) for r in runs},
                    # Per request (diagnosis: which requests missed the SLO, and when).
                    "requests": {
                        r.mode: [
                            {
                                "t": round(q.t, 3),
                                "ttft": None if q.ttft is None else round(q.ttft, 3),
                                "mean_itl": round(sum(q.gaps) / len(q.gaps), 4) if q.gaps else None,
                                "ok": q.ok,
                            }
                            for q in r.reqs
                        ]
                        for r in runs
                    },
                },
                indent=1,
            )
        )
    print()
    print(table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
