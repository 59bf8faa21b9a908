"""Two regions on this machine: what crossing the gateway adds, and how long a failover takes.

    .venv/bin/python -m bench.regions [--requests 60] [--max-tokens 16] [--per-token-s 0.005] \
        [--streams 4] [--json out.json]

Two NATS clusters, "a" and "b", one server each, joined by a gateway (bench.support.regions);
in each a router, two FAKE-engine workers (``libs/backend/fake.py``: timed pseudo-words, a load
test of routing and streaming, never of a model) and a gateway, as separate processes.

1. **local**: ``--requests`` streamed chat completions one at a time, alternating between a's
   gateway (run by a's workers) and b's (run by b's).
2. **failover**: ``--streams`` long streams open through a's gateway, then a's workers are
   SIGKILLed; one client keeps sending through a's gateway, one request at a time. Printed: the
   time from the kill to the first token of the first request sent after it (new requests'
   failover), the longest silence of each open stream (its migration to b), and whether every
   stream ended with its exact text.
3. **crossing**: ``--requests`` more, alternating between a's gateway (a has no worker now:
   run by b's, across the gateway) and b's (run by b's, local). The difference of the two is
   what the crossing adds on this machine: two more server hops (a → gateway → b) for the
   request's assignment and for each streamed message; on real links add their RTT.

Prints a table of TTFT and total time (p50 / p90, ms) per path, and the failover figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from bench.chaos.load import reference
from bench.stats import pct
from bench.support.regions import Call, RegionFleet, Supercluster, chat, fake_config


def summary(calls: list[Call]) -> dict[str, Any]:
    ok = [c for c in calls if c.ok and c.t_first is not None and c.t_end is not None]
    ttft = [(c.t_first or 0) - c.t_send for c in ok]
    total = [(c.t_end or 0) - c.t_send for c in ok]
    return {
        "n": len(calls),
        "ok": len(ok),
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 2),
        "ttft_p90_ms": round(pct(ttft, 0.9) * 1000, 2),
        "total_p50_ms": round(pct(total, 0.5) * 1000, 2),
        "total_p90_ms": round(pct(total, 0.9) * 1000, 2),
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1000, 2) if ttft else None,
    }


async def alternate(
    http: httpx.AsyncClient, urls: dict[str, str], n: int, max_tokens: int, base: int
) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {g: [] for g in urls}
    for k in range(n):
        g = list(urls)[k % len(urls)]
        c = Call(g, f"bench {base + k} via {g}", base + k, max_tokens)
        out[g].append(await chat(http, urls[g], c))
    return out


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sc = Supercluster(tmp / "nats", ["a", "b"])
    sc.start()
    config = fake_config(args.per_token_s)
    result: dict[str, Any] = {"engine": "FAKE", "per_token_s": args.per_token_s}
    try:
        with (
            RegionFleet(tmp / "a", sc, "a", config) as a,
            RegionFleet(tmp / "b", sc, "b", config) as b,
        ):
            a.wait_workers(4)
            b.wait_workers(4)
            async with httpx.AsyncClient(timeout=60) as http:
                await alternate(http, {"a": a.url, "b": b.url}, 4, args.max_tokens, 0)  # warm
                local = await alternate(
                    http, {"a": a.url, "b": b.url}, args.requests, args.max_tokens, 1000
                )
                result["local_a"] = summary(local["a"])
                result["local_b"] = summary(local["b"])

                long_tokens = max(int(3.0 / args.per_token_s), 20)
                running = [
                    Call("a", f"long stream {k}", 5000 + k, long_tokens)
                    for k in range(args.streams)
                ]
                tasks = [asyncio.create_task(chat(http, a.url, c)) for c in running]
                for _ in range(200):  # every stream has begun (10 s at most)
                    if all(c.texts for c in running):
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                t_kill = time.perf_counter()
                a.kill_workers()
                after: list[Call] = []
                while len(after) < 5:
                    c = Call("a", f"after the kill {len(after)}", 6000 + len(after), 8)
                    after.append(await chat(http, a.url, c))
                await asyncio.gather(*tasks)
                silences = []
                for c in running:
                    marks = [t_kill, *[t for t in c.token_times if t > t_kill], c.t_end or t_kill]
                    silences.append(max(y - x for x, y in pairwise(marks)))
                exact = [
                    c.ok and c.text == await reference(c.prompt, c.seed, c.max_tokens)
                    for c in running + after
                ]
                first = after[0]
                result["failover"] = {
                    "streams": len(running),
                    "streams_exact": sum(exact[: len(running)]),
                    "new_requests": len(after),
                    "new_exact": sum(exact[len(running) :]),
                    "kill_to_first_token_s": round((first.t_first or float("nan")) - t_kill, 3),
                    "first_request_total_s": round((first.t_end or 0) - first.t_send, 3),
                    "stream_silence_max_s": round(max(silences), 3),
                    "stream_silence_p50_s": round(statistics.median(silences), 3),
                }

                cross = await alternate(
                    http, {"a": a.url, "b": b.url}, args.requests, args.max_tokens, 2000
                )
                result["cross_a_to_b"] = summary(cross["a"])
                result["local_b_again"] = summary(cross["b"])
    finally:
        sc.stop()
    return result


def table(r: dict[str, Any]) -> str:
    rows = [
        ("a's gateway → a's workers (local)", r["local_a"]),
        ("b's gateway → b's workers (local)", r["local_b"]),
        ("a's gateway → b's workers (across the gateway)", r["cross_a_to_b"]),
        ("b's gateway → b's workers (local, same time)", r["local_b_again"]),
    ]
    out = [
        "| path | n ok | TTFT p50 (ms) | TTFT p90 (ms) | total p50 (ms) | total p90 (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in rows:
        out.append(
            f"| {name} | {s['ok']}/{s['n']} | {s['ttft_p50_ms']} | {s['ttft_p90_ms']} "
            f"| {s['total_p50_ms']} | {s['total_p90_ms']} |"
        )
    added = r["cross_a_to_b"]["ttft_p50_ms"] - r["local_b_again"]["ttft_p50_ms"]
    out.append(f"crossing adds {added:.2f} ms to TTFT p50")
    f = r["failover"]
    out.append(
        f"failover: kill → first token of the next request {f['kill_to_first_token_s']} s; "
        f"open streams' longest silence max {f['stream_silence_max_s']} s "
        f"p50 {f['stream_silence_p50_s']} s; exact text {f['streams_exact']}/{f['streams']} "
        f"streams, {f['new_exact']}/{f['new_requests']} new requests"
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="requests per phase (alternating)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--per-token-s", type=float, default=0.005)
    ap.add_argument("--streams", type=int, default=4, help="streams open at the kill")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="strait-regions-") as d:
        r = asyncio.run(run(args, Path(d)))
    print(table(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
