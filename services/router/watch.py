"""Requests placed and not yet ended, so a lost worker's requests can move on.

From its assignment until its stream ends, a request is *watched*: the router subscribes to the
request's stream subject (before it offers the assignment, so nothing is missed) and keeps what
a move needs — the last ``seq`` seen and choice 0's streamed tokens and text — until
``Finished`` or an ``ErrorMessage``. When the registry expires the request's worker first,
``Router.worker_lost`` places it again with ``attempt + 1``: from scratch when no token was
streamed yet, otherwise as a migration (``Migrated`` on the stream, then the tokens so far on
``Assignment.migration``). Workers ignore a duplicate assignment of a request id they already
run, so a worker that was only slow does not run it twice. In a disaggregated pool the decode
worker that admits the handoff announces itself (``StreamOwner``); from then on its loss, not
the prefill worker's, moves the request (through a prefill worker again).

State is bounded: at most ``router.max_watched`` requests (past that, new requests are served
but not watched, and a warning names the setting), each forgotten after ``router.watch_ttl_s``
without a stream message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.log import fields
from libs.protocol import (
    ErrorMessage,
    Finished,
    GenerateRequest,
    Migration,
    RouteReason,
    Subjects,
    TokenDelta,
    decode_stream,
)
from services.router import metrics

log = logging.getLogger("strait.router")


@dataclass
class Watched:
    req: GenerateRequest
    sub: Subscription
    seen: float  # time.monotonic() of the last stream message (or of the first placement)
    route: RouteReason | None = None
    attempt: int = 0
    lost: set[str] = field(default_factory=set)  # workers that died holding it
    last_seq: int = 0  # highest seq seen on the stream (router's own Migrated included)
    num_deltas: int = 0  # TokenDeltas seen, any choice
    tokens: list[int] = field(default_factory=list)  # choice 0's streamed token ids, in order
    text: list[str] = field(default_factory=list)  # choice 0's streamed text pieces
    finished: bool = False  # choice 0's last delta was seen
    # Placed on a prefill worker. Its loss moves the request only until a decode worker
    # announces it holds the request (StreamOwner → ``handed_off``, ``route`` names it).
    disaggregated: bool = False
    handed_off: bool = False
    deltas_at_placement: int = 0  # num_deltas when the current placement was made
    # False once the router's connection reconnected while watching: stream messages may have
    # been missed, so the tokens above cannot seed a migration.
    complete: bool = True
    final: Finished | None = None  # the stream's Finished, once seen

    @property
    def streamed(self) -> bool:
        """Output reached the client: placing from scratch would repeat it."""
        return self.num_deltas > 0

    def migration(self, from_worker: str) -> Migration:
        """What the next worker needs; its first message follows the Migrated marker."""
        return Migration(
            from_worker=from_worker,
            output_token_ids=list(self.tokens),
            output_text="".join(self.text),
            finished=self.finished,
            next_seq=self.last_seq + 2,
        )

    def on_message(self, data: bytes) -> bool:
        """Record one stream message; True when the stream has ended."""
        try:
            msg = decode_stream(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if msg.seq <= self.last_seq:
            return False  # a duplicate (a presumed-lost worker that came back)
        self.last_seq = msg.seq
        self.seen = time.monotonic()
        if isinstance(msg, TokenDelta):
            self.num_deltas += 1
            if msg.index == 0:
                self.tokens += msg.token_ids
                self.text.append(msg.text)
                self.finished = msg.finish_reason is not None
            return False
        if isinstance(msg, Finished):
            self.final = msg
        return isinstance(msg, Finished | ErrorMessage)


class StreamWatch:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        max_watched: int,
        ttl_s: float,
        on_end: Callable[[GenerateRequest, Finished | None], None] | None = None,
    ) -> None:
        """``on_end(req, finished)`` runs once for each request the watch forgets."""
        self.on_end = on_end
        self.nc = nc
        self.subjects = subjects
        self.max_watched = max_watched
        self.ttl_s = ttl_s
        self.watched: dict[str, Watched] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def watch(self, req: GenerateRequest) -> bool:
        """Start watching ``req`` (before its first offer); False when at the bound. Requests
        are keyed by ``GenerateRequest.key`` (two teams may use the same id)."""
        rid = req.key
        if rid in self.watched:
            return True
        if len(self.watched) >= self.max_watched:
            metrics.UNWATCHED.inc()
            log.warning(
                "too many requests watched; this one cannot move if its worker is lost "
                "(raise router.max_watched)",
                extra=fields(request_id=rid, max_watched=self.max_watched),
            )
            return False

        async def on_msg(msg: Msg) -> None:
            w = self.watched.get(rid)
            if w is not None and w.on_message(msg.data):
                # NOTE: not from inside this callback: nats-py cancels a subscription's callback
                # task when it unsubscribes, which would cut the UNSUB itself short.
                t = asyncio.create_task(self.forget(rid))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

        subject = req.reply_subject or self.subjects.stream(req.request_id)
        sub = await self.nc.subscribe(subject, cb=on_msg)
        self.watched[rid] = Watched(req=req, sub=sub, seen=time.monotonic())
        return True

    def assigned(self, rid: str, route: RouteReason, attempt: int, disaggregated: bool) -> None:
        w = self.watched.get(rid)
        if w is not None:
            w.route, w.attempt, w.disaggregated = route, attempt, disaggregated
            w.handed_off, w.deltas_at_placement = False, w.num_deltas

    def streamed_unannounced(self, w: Watched) -> bool:
        """A disaggregated request that streams since its placement, from a decode worker not
        yet announced: its prefill worker's loss does not concern it."""
        return w.disaggregated and not w.handed_off and w.num_deltas > w.deltas_at_placement

    def owner(self, rid: str, worker_id: str) -> None:
        """A decode worker admitted ``rid``'s handoff: its loss, not the prefill worker's, now
        moves the request."""
        w = self.watched.get(rid)
        if w is not None and w.route is not None:
            w.route = msgspec.structs.replace(w.route, worker_id=worker_id)
            w.handed_off = True

    def next_seq(self, rid: str) -> int:
        """The seq a message the router adds to ``rid``'s stream must carry."""
        w = self.watched.get(rid)
        return w.last_seq + 1 if w is not None else 1

    async def forget(self, rid: str) -> None:
        w = self.watched.pop(rid, None)
        if w is not None:
            if self.on_end is not None:
                self.on_end(w.req, w.final)
            await _unsubscribe(w.sub)

    def on_worker_lost(self, worker_id: str) -> list[Watched]:
        """The watched requests that ``worker_id`` held (they stay watched)."""
        hit = [w for w in self.watched.values() if w.route and w.route.worker_id == worker_id]
        for w in hit:
            w.lost.add(worker_id)
        return hit

    async def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rid in [r for r, w in self.watched.items() if now - w.seen > self.ttl_s]:
            await self.forget(rid)

    def reconnected(self) -> None:
        """The router's connection reconnected: what streamed meanwhile was missed."""
        for w in self.watched.values():
            w.complete = False

    def stalled(self, stall_s: float, now: float | None = None) -> list[Watched]:
        """Streams that began and then went silent for ``stall_s`` while placed (each reported
        once: its silence clock restarts)."""
        now = time.monotonic() if now is None else now
        out = [
            w
            for w in self.watched.values()
            if w.route is not None and w.num_deltas > 0 and now - w.seen > stall_s
        ]
        for w in out:
            w.seen = now
        return out

    async def close(self) -> None:
        for rid in list(self.watched):
            await self.forget(rid)
        if self._tasks:
            await asyncio.wait(self._tasks)


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # connection closing or already unsubscribed
        pass
