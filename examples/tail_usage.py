"""Live tail of the fleet's usage events (one line each), with a durable consumer of your own.

    python -m examples.tail_usage --nats nats://127.0.0.1:4222 --durable team-x

With ``--durable`` the server remembers what you have seen: stop and start again and you resume
where you left off (events are acked once printed). Without, you follow from ``--deliver``
(``new`` by default; ``all`` replays what the stream retains). ``--kind route`` tails routing
decisions instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Literal, TextIO

import msgspec

from libs.client import StraitClient
from libs.protocol import RouteDecision, UsageEvent


def format_event(ev: UsageEvent | RouteDecision, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(msgspec.to_builtins(ev))
    if isinstance(ev, RouteDecision):
        r = ev.route
        return f"{ev.request_id} → {r.pool}/{r.worker_id} ({r.code}, overlap {r.overlap_blocks})"
    err = f" {ev.error_code}" if ev.error_code else ""
    return (
        f"{ev.request_id} {ev.status}{err} key={ev.api_key_id or '-'} {ev.pool}/{ev.worker_id} "
        f"prompt={ev.prompt_tokens} completion={ev.completion_tokens} cached={ev.cached_tokens} "
        f"total={ev.total_s:.3f}s src={ev.source}"
    )


async def run(
    client: StraitClient,
    *,
    kind: Literal["usage", "route"] = "usage",
    durable: str | None = None,
    deliver: Literal["all", "new"] = "new",
    limit: int | None = None,
    max_idle_s: float | None = None,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """Print events until ``limit`` events, ``max_idle_s`` of silence, or cancellation."""
    seen = 0
    async with client.observe(kind, durable, deliver=deliver, max_idle_s=max_idle_s) as events:
        async for ev in events:
            print(format_event(ev, as_json), file=out, flush=True)
            seen += 1
            if limit is not None and seen >= limit:
                break
    return seen


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nats", default="nats://127.0.0.1:4222")
    p.add_argument("--prefix", default="strait.v1")
    p.add_argument("--events-stream", default="STRAIT_EVENTS")
    p.add_argument("--kind", choices=["usage", "route"], default="usage")
    p.add_argument("--durable", help="consumer name of your own (resumable)")
    p.add_argument("--deliver", choices=["all", "new"], default="new")
    p.add_argument("--limit", type=int, help="stop after this many events")
    p.add_argument("--json", action="store_true", help="print each event as JSON")
    return p


async def _main(args: argparse.Namespace) -> int:
    async with StraitClient(args.nats, prefix=args.prefix, events_stream=args.events_stream) as c:
        await run(c, kind=args.kind, durable=args.durable, deliver=args.deliver,
                  limit=args.limit, as_json=args.json)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return asyncio.run(_main(parser().parse_args(argv)))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
