"""Run-time control of a pool's LoRA adapters: ``strait adapters load|unload|list`` and the
gateway's admin endpoint send one ``AdapterCommand`` to ``Subjects.adapters(pool)`` and
gather every worker's ``AdapterReply`` (docs/engine.md "LoRA adapters").

Every worker of the pool subscribes to that subject (``Worker.on_adapters``) and acts on its
own engine between steps; an unload lets the requests running on the adapter finish first.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from libs.protocol import AdapterCommand, AdapterReply, Subjects, encode
from libs.settings import Settings


async def send(
    nc: NATS,
    subjects: Subjects,
    pool: str,
    cmd: AdapterCommand,
    wait_s: float,
    expect: int = 0,
) -> list[AdapterReply]:
    """Publish ``cmd`` to ``pool``'s workers; the replies that arrive within ``wait_s`` (sooner
    once ``expect`` workers have answered, when ``expect`` > 0)."""
    replies: list[AdapterReply] = []
    inbox = nc.new_inbox()
    enough = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        try:
            replies.append(msgspec.json.decode(msg.data, type=AdapterReply))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not a worker's answer: nothing to count
        if 0 < expect <= len({r.worker_id for r in replies}):
            enough.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subjects.adapters(pool), encode(cmd), reply=inbox)
        await nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), wait_s)
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda r: r.worker_id)


def run_cli(settings: Settings, action: str, name: str, pool: str, path: str) -> int:
    """``strait adapters``: prints one line per worker; 1 when none answered or one failed."""
    from libs.wire.nats_util import connect

    if action != "list" and not name:
        print(f"strait adapters {action} needs an adapter name", file=sys.stderr)
        return 2
    pool = pool or settings.pools[0].name

    async def run() -> list[AdapterReply]:
        nc = await connect(settings.nats, "strait-adapters")
        try:
            cmd = AdapterCommand(action=action, name=name, path=path)  # type: ignore[arg-type]
            return await send(
                nc, Subjects.of(settings.nats), pool, cmd, settings.router.assign_timeout_s
            )
        finally:
            await nc.close()

    replies = asyncio.run(run())
    if not replies:
        print(f"no worker of pool {pool!r} answered", file=sys.stderr)
        return 1
    for r in replies:
        state = "ok" if r.ok else f"failed: {r.error}"
        print(f"{r.worker_id}: {state}; loaded: {', '.join(r.loaded) or '(none)'}")
    return 0 if all(r.ok for r in replies) else 1
