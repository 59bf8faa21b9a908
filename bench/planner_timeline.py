"""A scale-up timeline on this machine: `strait up` with FAKE-engine workers and the planner
(local actuator), a calm load, a wave past one worker's capacity, then calm again. Prints one
row a second: offered load, the planner's decision (replicas, reason, forecast), workers
beating (and draining), requests waiting in workers, and the TTFT of the requests sent that
second; then when the planner decided, when the new workers beat, and what was lost.

    .venv/bin/python -m bench.planner_timeline                  # ~90 s
    .venv/bin/python -m bench.planner_timeline --wave-rps 12 --max-replicas 4
    .venv/bin/python -m bench.planner_timeline --standby 3     # scale-out from warm standby

The workers run the FAKE engine (libs/backend/fake.py: sleeps, no model): this measures the
planner, the supervisor and a worker's start on this machine, not a model's speed. A worker
runs ``--slots`` requests at once, each ``--tokens`` x ``--per-token-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from dataclasses import dataclass, field

import msgspec

from bench.support.up import strait_up
from libs.client import StraitClient
from libs.protocol import PlanDecision, Subjects, WorkerBeat
from libs.settings import NatsSettings
from libs.wire.nats_util import connect

START_TIMEOUT_S = 120.0  # for `strait up` to say "fleet ready"

CONFIG = """
[gateway]
auth_enabled = false
[router]
metrics_port = 0
[worker]
drain_timeout_s = 30.0
[engine]
max_num_seqs = {slots}
[fake_engine]
per_token_s = {per_token_s}
per_prompt_token_s = 0.0
[planner]
enabled = true
warm_standby = {standby}
metrics_port = 0
interval_s = {interval_s}
bucket_s = {bucket_s}
horizon_s = {horizon_s}
min_history_buckets = 3
scale_up_cooldown_s = 2.0
scale_down_cooldown_s = 10.0
scale_down_stable_s = 10.0
min_samples = 10
[planner.default]
min_replicas = 1
max_replicas = {max_replicas}
ttft_slo_s = {ttft_slo_s}
itl_slo_s = 0.1
prior_service_s = {service_s}
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
workers = 1
"""


@dataclass
class Timeline:
    t0: float
    plans: list[tuple[float, PlanDecision]] = field(default_factory=list)
    beats: list[tuple[float, WorkerBeat]] = field(default_factory=list)
    sent: list[tuple[float, float | None, bool]] = field(default_factory=list)  # t, ttft, ok


async def run_load(args: argparse.Namespace, url: str, prefix: str, tl: Timeline) -> None:
    nc = await connect(NatsSettings(url=url), "bench-planner")
    subjects = Subjects(prefix)

    async def on_plan(msg: object) -> None:
        d = msgspec.json.decode(msg.data, type=PlanDecision)  # type: ignore[attr-defined]
        tl.plans.append((time.monotonic() - tl.t0, d))

    async def on_beat(msg: object) -> None:
        b = msgspec.json.decode(msg.data, type=WorkerBeat)  # type: ignore[attr-defined]
        tl.beats.append((time.monotonic() - tl.t0, b))

    await nc.subscribe(subjects.plans_all, cb=on_plan)
    await nc.subscribe(subjects.beats_all, cb=on_beat)
    phases = [
        (args.calm_rps, args.calm_s),
        (args.wave_rps, args.wave_s),
        (args.calm_rps, args.after_s),
    ]
    async with StraitClient(url, prefix=prefix, report_usage=False) as client:

        async def one(i: int) -> None:
            sent = time.monotonic()
            first: float | None = None
            ok = False
            try:
                async with client.generate(
                    f"timeline {i}", max_tokens=args.tokens, ignore_eos=True
                ) as gen:
                    async for _ in gen:
                        if first is None:
                            first = time.monotonic() - sent
                    ok = gen.usage is not None and gen.usage.completion_tokens == args.tokens
            except Exception:
                ok = False
            tl.sent.append((sent - tl.t0, first, ok))

        tasks, i = [], 0
        for rps, seconds in phases:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(1 / rps)
        await asyncio.gather(*tasks)
    await asyncio.sleep(2)
    await nc.drain()


def report(args: argparse.Namespace, tl: Timeline, machine: str) -> None:
    end = int(max([t for t, _ in tl.beats] + [0.0])) + 1
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine}; FAKE engine, "
        f"{args.slots} slots x {args.tokens} tokens x {args.per_token_s} s; calm "
        f"{args.calm_rps}/s {args.calm_s:g} s, wave {args.wave_rps}/s {args.wave_s:g} s, "
        f"calm {args.after_s:g} s; warm standby {args.standby}"
    )
    print(
        "| t s | sent/s | target | reason | forecast rps | workers | draining | waiting | TTFT p50 s |"
    )
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for sec in range(end):
        plans = [d for t, d in tl.plans if sec <= t < sec + 1]
        beats = {b.worker_id: b for t, b in tl.beats if sec <= t < sec + 1}
        sent = [s for s in tl.sent if sec <= s[0] < sec + 1]
        ttfts = sorted(f for _, f, _ in sent if f is not None)
        d = plans[-1] if plans else None
        print(
            f"| {sec} | {len(sent)} | {d.replicas if d else ''} | {d.reason if d else ''} | "
            f"{f'{d.forecast_rps:.1f}' if d else ''} | "
            f"{sum(not b.draining for b in beats.values())} | "
            f"{sum(b.draining for b in beats.values())} | "
            f"{sum(b.waiting for b in beats.values())} | "
            f"{f'{ttfts[len(ttfts) // 2]:.2f}' if ttfts else ''} |"
        )
    wave_at = args.calm_s
    first_up = next((t for t, d in tl.plans if d.reason == "scale_up" and t >= wave_at), None)
    first_seen: dict[str, float] = {}
    for t, b in tl.beats:
        first_seen.setdefault(b.worker_id, t)
    new = sorted(t for t in first_seen.values() if t >= wave_at)
    peak = max((d.replicas for t, d in tl.plans), default=0)
    full = new[peak - 2] if peak >= 2 and len(new) >= peak - 1 else None
    lost = sum(not ok for *_, ok in tl.sent)
    print()
    print(f"wave starts at {wave_at:.1f} s")
    if first_up is not None:
        print(f"first scale_up decision: +{first_up - wave_at:.1f} s")
    if new:
        print(f"first new worker beating: +{new[0] - wave_at:.1f} s")
    if full is not None:
        print(f"all {peak} workers beating: +{full - wave_at:.1f} s")
    print(f"requests: {len(tl.sent)} sent, {lost} not completed whole")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.planner_timeline", description=__doc__)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--per-token-s", type=float, default=0.025)
    p.add_argument("--calm-rps", type=float, default=1.0)
    p.add_argument("--calm-s", type=float, default=15.0)
    p.add_argument("--wave-rps", type=float, default=10.0)
    p.add_argument("--wave-s", type=float, default=30.0)
    p.add_argument("--after-s", type=float, default=40.0)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--standby", type=int, default=0, help="planner.warm_standby")
    p.add_argument("--ttft-slo-s", type=float, default=1.0)
    p.add_argument("--interval-s", type=float, default=0.5)
    p.add_argument("--bucket-s", type=float, default=1.0)
    p.add_argument("--horizon-s", type=float, default=10.0)
    args = p.parse_args(argv)
    config = CONFIG.format(
        slots=args.slots,
        per_token_s=args.per_token_s,
        interval_s=args.interval_s,
        bucket_s=args.bucket_s,
        horizon_s=args.horizon_s,
        max_replicas=args.max_replicas,
        standby=args.standby,
        ttft_slo_s=args.ttft_slo_s,
        service_s=args.tokens * args.per_token_s,
    )
    try:
        with strait_up(config, "planbench.v1", "planner", START_TIMEOUT_S) as up:
            tl = Timeline(time.monotonic())
            asyncio.run(run_load(args, up.url, up.prefix, tl))
    except RuntimeError as e:
        print(e)
        return 1
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    report(args, tl, machine)
    print(f"fleet log: {up.log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
