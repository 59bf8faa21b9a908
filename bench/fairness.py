"""Flow control measured on a running fleet (docs/flow-control.md).

Phases, one after another on the same fleet:

1. ``solo``: a quiet tenant alone, one short streaming chat at a time: its TTFT p50/p99;
2. ``flood``: another tenant keeps ``--streams`` streams open (each answered one replaced by a
   new one): its output tokens/s alone;
3. ``beside``: the quiet tenant again, beside that flood: its TTFT against phase 1;
4. ``equal`` and ``weighted``: two floods of ``--streams`` each, weights 1:1 and 3:1: each
   one's share of the output tokens, and their total tokens/s against phase 2.

Tenants are API keys made here in the fleet's database (``--over http``, through the
gateway), or teams named on requests published to the fleet's requests subject
(``--over nats``: the trusted fleet account, whose requests name their team and weight).

    python -m bench.fairness --base-url http://127.0.0.1:8000      # `make run`'s fleet
    python -m bench.fairness --over nats --phase-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import nats

from bench.stats import pct
from libs.db.keys import FlowTerms, create_key
from libs.protocol import (
    ErrorMessage,
    Finished,
    GenerateRequest,
    SamplingParams,
    Subjects,
    TokenDelta,
    decode_stream,
)
from libs.settings import get_settings

QUIET_PROMPT = "Say hello in five words."
FLOOD_PROMPT = "Write a long story about a river, a bridge and a boat."

# One request: (tenant, prompt, max_tokens, the time each output token arrived) → None.
Send = Callable[[str, str, int, list[float]], Awaitable[None]]


@dataclass
class Tally:
    tokens: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by error

    def seen(self, tenant: str) -> list[float]:
        return self.tokens.setdefault(tenant, [])

    def rate(self, tenant: str, lo: float, hi: float) -> float:
        return sum(lo <= t <= hi for t in self.seen(tenant)) / (hi - lo)


async def http_sender(base: str, weights: dict[str, float]) -> tuple[Send, httpx.AsyncClient]:
    """One API key per tenant (weights as given), made in the fleet's database."""
    headers = {}
    for tenant, w in weights.items():
        _, secret = await create_key(get_settings(), f"bench-{tenant}", terms=FlowTerms(w))
        headers[tenant] = {"Authorization": f"Bearer {secret}"}
    client = httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=512))

    async def send(tenant: str, prompt: str, max_tokens: int, seen: list[float]) -> None:
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers[tenant]
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                    seen.append(time.monotonic())

    return send, client


async def nats_sender(url: str, weights: dict[str, float]) -> tuple[Send, nats.NATS]:
    """Requests on the fleet's requests subject naming their team and weight."""
    nc = await nats.connect(url)
    subjects = Subjects.of(get_settings().nats)

    async def send(tenant: str, prompt: str, max_tokens: int, seen: list[float]) -> None:
        rid = f"fair-{uuid.uuid4().hex[:12]}"
        sub = await nc.subscribe(subjects.stream(rid))
        req = GenerateRequest(
            request_id=rid,
            prompt=prompt,
            sampling=SamplingParams(max_tokens=max_tokens),
            team=tenant,
            tenant_weight=weights[tenant],
        )
        try:
            await nc.jetstream().publish(subjects.requests, msgspec.json.encode(req))
            while True:
                msg = decode_stream((await sub.next_msg(timeout=600)).data)
                if isinstance(msg, TokenDelta) and msg.token_ids:
                    seen.extend([time.monotonic()] * len(msg.token_ids))
                if isinstance(msg, Finished | ErrorMessage):
                    return
        finally:
            await sub.unsubscribe()

    return send, nc


async def flood(
    send: Send, tenants: list[str], streams: int, tokens: int, until: float, tally: Tally
) -> None:
    """``streams`` open streams of each tenant, opened alternately, each answered request
    replaced by a new one until ``until``."""

    async def one_stream(tenant: str) -> None:
        while time.monotonic() < until:
            try:
                await send(tenant, FLOOD_PROMPT, tokens, tally.seen(tenant))
            except RuntimeError as e:  # a typed refusal (over_share, a timeout): counted
                key = f"{tenant}: {str(e)[:60]}"
                tally.errors[key] = tally.errors.get(key, 0) + 1
                await asyncio.sleep(1.0)

    await asyncio.gather(*(one_stream(t) for _ in range(streams) for t in tenants))


async def quiet(send: Send, until: float) -> list[float]:
    """TTFTs (s) of one short chat at a time until ``until``."""
    ttfts = []
    while time.monotonic() < until:
        t0, seen = time.monotonic(), []
        await send("quiet", QUIET_PROMPT, 8, seen)
        if seen:
            ttfts.append(seen[0] - t0)
    return ttfts


async def run(args: argparse.Namespace) -> dict[str, object]:
    weights = {"quiet": 1.0, "flood": 1.0, "a": 1.0, "b": 1.0, "heavy": 3.0, "light": 1.0}
    async with httpx.AsyncClient(base_url=args.base_url) as c:
        while (await c.get("/ready")).status_code != 200:  # a worker beats (its graphs ready)
            print("waiting for the fleet's /ready", flush=True)
            await asyncio.sleep(5)
    if args.over == "http":
        send, closer = await http_sender(args.base_url, weights)
    else:
        send, closer = await nats_sender(args.nats_url, weights)
    out: dict[str, object] = {"over": args.over, "streams": args.streams}
    warm, span = args.warmup_s, args.phase_s
    try:
        print("solo: the quiet tenant alone", flush=True)
        solo = await quiet(send, time.monotonic() + span)
        out["solo_ttft_ms"] = {"p50": pct(solo, 0.5) * 1e3, "p99": pct(solo, 0.99) * 1e3}
        print("flood alone, then the quiet tenant beside it", flush=True)
        t = Tally()
        start = time.monotonic()
        end = start + warm + 2 * span
        flooding = asyncio.create_task(flood(send, ["flood"], args.streams, args.tokens, end, t))
        await asyncio.sleep(warm + span)
        out["flood_tok_s"] = t.rate("flood", start + warm, start + warm + span)
        out["flood_errors"] = t.errors
        beside = await quiet(send, end)
        await flooding
        out["beside_ttft_ms"] = {"p50": pct(beside, 0.5) * 1e3, "p99": pct(beside, 0.99) * 1e3}
        out["ttft_p99_ratio"] = pct(beside, 0.99) / pct(solo, 0.99)
        for name, (x, y) in (("equal", ("a", "b")), ("weighted", ("heavy", "light"))):
            print(f"two floods, {name} ({weights[x]:g}:{weights[y]:g})", flush=True)
            t = Tally()
            start = time.monotonic()
            end = start + warm + span
            await flood(send, [x, y], args.streams, args.tokens, end, t)
            rx, ry = (t.rate(n, start + warm, end) for n in (x, y))
            out[name] = {"share": rx / (rx + ry), "total_tok_s": rx + ry, "errors": t.errors}
            out[f"{name}_throughput_ratio"] = (rx + ry) / out["flood_tok_s"]  # type: ignore[operator]
    finally:
        await closer.aclose() if isinstance(closer, httpx.AsyncClient) else await closer.close()
    out["solo_requests"], out["beside_requests"] = len(solo), len(beside)
    out["quiet_ttft_ms_mean"] = statistics.fmean(beside) * 1e3 if beside else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--over", choices=("http", "nats"), default="http")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--streams", type=int, default=96, help="open streams of each flood")
    p.add_argument("--tokens", type=int, default=64, help="output tokens of a flood's request")
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds each phase measures")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=30.0,
        help="seconds a flood runs first (at least a few of its requests' lifetimes: shares "
        "converge as seats turn over)",
    )
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
