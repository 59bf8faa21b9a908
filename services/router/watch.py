"""Requests placed but not yet started, so a lost worker's requests can be placed again.

From its assignment until its first stream message, a request is *watched*: the router
subscribes to the request's stream subject (before it offers the assignment, so nothing is
missed) and forgets the request on the first message that is not the optional ``Routed`` echo
(a token, ``Finished`` or an ``ErrorMessage``: the worker has started, or answered). When the
registry expires the request's worker first, the router places the request again with
``attempt + 1`` (see ``Router.worker_lost``). Workers ignore a duplicate assignment of a request
id they already run, so a worker that was only slow does not run it twice.

State is bounded: at most ``router.max_watched`` requests (past that, new requests are served
but not watched, and a warning names the setting), each for at most ``router.watch_ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.log import fields
from libs.protocol import GenerateRequest, Routed, RouteReason, Subjects, decode_stream
from services.router import metrics

log = logging.getLogger("strait.router")


@dataclass
class Watched:
    req: GenerateRequest
    sub: Subscription
    since: float  # time.monotonic() when first placed
    route: RouteReason | None = None
    attempt: int = 0
    lost: set[str] = field(default_factory=set)  # workers that died holding it


class StartWatch:
    def __init__(self, nc: NATS, subjects: Subjects, max_watched: int, ttl_s: float) -> None:
        self.nc = nc
        self.subjects = subjects
        self.max_watched = max_watched
        self.ttl_s = ttl_s
        self.watched: dict[str, Watched] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def watch(self, req: GenerateRequest) -> bool:
        """Start watching ``req`` (before its first offer); False when at the bound."""
        rid = req.request_id
        if rid in self.watched:
            return True
        if len(self.watched) >= self.max_watched:
            metrics.UNWATCHED.inc()
            log.warning(
                "too many requests awaiting their first token; not re-placeable "
                "(raise router.max_watched)",
                extra=fields(request_id=rid, max_watched=self.max_watched),
            )
            return False

        async def on_msg(msg: Msg) -> None:
            try:
                first = decode_stream(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            if not isinstance(first, Routed) and rid in self.watched:
                # NOTE: not from inside this callback: nats-py cancels a subscription's callback
                # task when it unsubscribes, which would cut the UNSUB itself short.
                t = asyncio.create_task(self.started(rid))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

        subject = req.reply_subject or self.subjects.stream(rid)
        sub = await self.nc.subscribe(subject, cb=on_msg)
        self.watched[rid] = Watched(req=req, sub=sub, since=time.monotonic())
        return True

    def assigned(self, rid: str, route: RouteReason, attempt: int) -> None:
        w = self.watched.get(rid)
        if w is not None:
            w.route, w.attempt = route, attempt

    async def started(self, rid: str) -> None:
        w = self.watched.pop(rid, None)
        if w is not None:
            await _unsubscribe(w.sub)

    def on_worker_lost(self, worker_id: str) -> list[Watched]:
        """The watched requests that ``worker_id`` held (they stay watched)."""
        hit = [w for w in self.watched.values() if w.route and w.route.worker_id == worker_id]
        for w in hit:
            w.lost.add(worker_id)
        return hit

    async def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rid in [r for r, w in self.watched.items() if now - w.since > self.ttl_s]:
            await self.started(rid)

    async def close(self) -> None:
        for rid in list(self.watched):
            await self.started(rid)
        if self._tasks:
            await asyncio.wait(self._tasks)


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # connection closing or already unsubscribed
        pass
