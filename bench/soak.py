"""A soak: steady streaming load on a FAKE-engine fleet for minutes, sampling memory and open
streams, to show they stay flat (no leak of streams, watches, writers or blocks).

    .venv/bin/python -m bench.soak --minutes 30 --streams 40 --every 60 [--json soak.json]

The fleet and the load are ``bench.chaos``'s (a JetStream nats-server, a router, three FAKE
aggregated workers, one gateway, 40 streams, one in four through ``StraitClient`` on NATS, each
slot sending its next request as soon as the last one ended) with no fault. Every ``--every``
seconds it records each process's resident memory (psutil) and the fleet's own gauges: the
gateway's requests in flight, the router's watched streams, the workers' running requests.
At the end it prints the samples and the change of each from the first sample after the warm-up
to the last, then the chaos columns for the whole run (completed, failed, hangs, bad text,
ledger rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.chaos.fleet import Fleet, Opts
from bench.chaos.load import Load
from bench.chaos.measure import measure

WARMUP_S = 120.0  # growth is measured from the first sample after this


def sample(fleet: Fleet) -> dict[str, Any]:
    """Resident MB of every fleet process, and the fleet's open-work gauges."""
    procs = {name: p.pid for name, p in fleet.procs.items() if p.poll() is None}
    if fleet.nats.proc is not None:
        procs["nats-server"] = fleet.nats.proc.pid
    rss = {}
    for name, pid in procs.items():
        try:
            rss[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            rss[name] = None
    gauges: dict[str, float | None] = {}
    for url in fleet.gateway_urls:
        gauges["gateway_inflight"] = fleet.scrape(url, "strait_gateway_inflight_requests")
    router = fleet.metrics_port.get("router")
    if router:
        gauges["router_watched"] = fleet.scrape(
            f"http://127.0.0.1:{router}", "strait_router_watched_requests"
        )
    running = [
        fleet.scrape(f"http://127.0.0.1:{port}", "strait_worker_running_requests")
        for name, port in fleet.metrics_port.items()
        if name.startswith("worker")
    ]
    gauges["workers_running"] = sum(r or 0.0 for r in running)
    return {"t_s": 0.0, "rss_mb": rss, **gauges}


async def soak(opts: Opts, every_s: float) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    with Fleet(opts.run_dir / "soak", opts) as fleet:
        load = Load(fleet, opts)
        t0 = time.monotonic()

        async def sampler() -> None:
            while not load.stop_new:
                s = await asyncio.to_thread(sample, fleet)
                s["t_s"] = round(time.monotonic() - t0, 1)
                samples.append(s)
                print(
                    f"[soak] {s['t_s']:7.0f} s  rss {sum(v or 0 for v in s['rss_mb'].values()):.0f}"
                    f" MB  inflight {s.get('gateway_inflight')}  watched "
                    f"{s.get('router_watched')}  running {s['workers_running']}",
                    file=sys.stderr,
                    flush=True,
                )
                await asyncio.sleep(every_s)

        await load.run(sampler)
        row = await measure("soak", fleet, load, None)
    return {"row": row, "samples": samples}


def growth(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Per process: MB at the last sample minus MB at the first one after the warm-up."""
    after = [s for s in samples if s["t_s"] >= WARMUP_S] or samples
    first, last = after[0]["rss_mb"], after[-1]["rss_mb"]
    return {
        n: round(last[n] - first[n], 1)
        for n in last
        if n in first and last[n] is not None and first[n] is not None
    }


def report(result: dict[str, Any]) -> str:
    samples, row = result["samples"], result["row"]
    names = sorted({n for s in samples for n in s["rss_mb"]})
    lines = [
        "| t (s) | " + " | ".join(f"{n} MB" for n in names) + " | gateway in flight | "
        "router watched | workers running |",
        "| ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |",
    ]
    for s in samples:
        mb = [str(s["rss_mb"].get(n, "")) for n in names]
        lines.append(
            f"| {s['t_s']:.0f} | "
            + " | ".join(mb)
            + f" | {s.get('gateway_inflight')} | {s.get('router_watched')} | "
            f"{s['workers_running']} |"
        )
    g = growth(samples)
    lines += [
        "",
        f"RSS change from the first sample after {WARMUP_S:.0f} s to the last: "
        + ", ".join(f"{n} {v:+.1f} MB" for n, v in sorted(g.items())),
        "",
        f"requests {row['requests']}, completed {row['completed']}, failed {row['failed']}, "
        f"hangs {row['hangs']}, bad text {row['bad_text']}, ledger lost {row['ledger_lost']}, "
        f"ledger wrong {row['ledger_wrong']}, held after {row['held_after_total']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="strait-soak-"))
    print(f"soak: logs under {run_dir}", file=sys.stderr, flush=True)
    opts = Opts(streams=args.streams, fault_at=0.5, after=args.minutes * 60, run_dir=run_dir)
    result = asyncio.run(soak(opts, args.every))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
