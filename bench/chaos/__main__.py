"""``python -m bench.chaos``: the campaign's options, its run and its table."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import bench.chaos
from bench.chaos import disagg, regions
from bench.chaos.campaign import RUNNERS, SCENARIOS, campaign, table
from bench.chaos.fleet import Opts
from bench.chaos.load import DISAGG_MAX_TOKENS, DISAGG_PROMPTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=bench.chaos.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order")
    p.add_argument("--streams", type=int, default=40, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--per-token-s", type=float, default=0.02, help="the FAKE engine's per token")
    p.add_argument("--fault-at", type=float, default=3.5, help="seconds of load before the fault")
    p.add_argument("--after", type=float, default=6.0, help="seconds of new requests after it")
    p.add_argument(
        "--bound",
        type=float,
        default=75.0,
        help="a request not ended this long after its send hangs (above the gateway's 60 s "
        "idle timeout, so a stream that timeout ends is a failure, not a hang)",
    )
    p.add_argument("--nats-every", type=int, default=4, help="every n-th stream on NATS; 0: none")
    p.add_argument("--malformed", type=int, default=10000, help="messages of the malformed run")
    p.add_argument(
        "--no-oversized", action="store_true", help="malformed: leave out the 1-4 MB request ids"
    )
    p.add_argument("--logs", default="", help="run directory (default: a new one under /tmp)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    run_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="strait-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    opts = Opts(
        streams=args.streams,
        max_tokens=args.max_tokens,
        per_token_s=args.per_token_s,
        fault_at=args.fault_at,
        after=args.after,
        bound=args.bound,
        nats_every=args.nats_every,
        malformed=args.malformed,
        oversized=not args.no_oversized,
        run_dir=run_dir,
    )
    print(f"chaos: logs under {run_dir}", file=sys.stderr, flush=True)
    rows = asyncio.run(campaign(names, opts))
    if any(n in regions.RUNNERS for n in names):
        print(
            f"\n{', '.join(n for n in names if n in regions.RUNNERS)}: two regions (NATS "
            f"clusters a and b joined by a gateway), each a router, 2 FAKE-engine workers and a "
            f"gateway; per_token_s {opts.per_token_s}, max_tokens {opts.max_tokens}, "
            f"{opts.streams} streams over both gateways, all HTTP; bound {opts.bound:g} s\n"
        )
    if any(n not in disagg.RUNNERS and n not in regions.RUNNERS for n in names):
        print(
            f"\nFAKE engine (libs/backend/fake.py), 3 aggregated workers, per_token_s "
            f"{opts.per_token_s}, max_tokens {opts.max_tokens}, {opts.streams} streams "
            f"(every {opts.nats_every or '–'}th on NATS, the rest HTTP); bound {opts.bound:g} s\n"
        )
    if any(n in disagg.RUNNERS for n in names):
        print(
            f"\n{', '.join(n for n in names if n in disagg.RUNNERS)}: the REAL engine on a tiny "
            f"random-weight model, one disaggregated pool (prefill p0 [p1 in kill-prefill], "
            f"decode w0 w1, the prefix-cache service), {opts.streams} streams (every "
            f"{opts.nats_every or '–'}th on NATS), greedy requests of "
            f"{len(DISAGG_PROMPTS)} prompts, max_tokens {min(opts.max_tokens, DISAGG_MAX_TOKENS)}\n"
        )
    print(table(rows))
    if args.json:
        meta = asdict(opts) | {"run_dir": str(run_dir)}
        Path(args.json).write_text(json.dumps({"opts": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
