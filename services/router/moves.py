"""Moving a placed request off a worker that can no longer finish it: its beats stopped
(``worker_lost``, from the registry's expiry) or its stream went silent while it still beats
(``stalled_streams``, past ``router.stall_timeout_s``). ``move`` places it again on another
worker of its pool: from scratch before its first token (code ``replaced``), as a migration
after (a ``Migrated`` marker on the stream, then ``Assignment.migration`` with the tokens so
far; decision 0012), or ends it with ``worker_lost`` when it may not move
(``router.max_attempts``, ``n > 1`` mid-stream, a stream the router missed part of). ``Router`` inherits it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from opentelemetry.trace import Tracer

from libs.log import fields
from libs.protocol import (
    CancelRequest,
    GenerateRequest,
    Migrated,
    Migration,
    RouteReason,
    Subjects,
    encode,
)
from libs.settings import FleetSettings, RouterSettings
from services.router import metrics
from services.router.decision import Decision, Rejection, span_attributes
from services.router.watch import StreamWatch, Watched

log = logging.getLogger("strait.router")


class Moves:
    """Mixed into ``Router``, which sets these attributes in its ``__init__`` and defines the
    methods declared below for the type checker."""

    nc: NATS
    subjects: Subjects
    cfg: RouterSettings
    fleet: FleetSettings
    watch: StreamWatch
    _tracer: Tracer

    if TYPE_CHECKING:

        def decide(
            self,
            req: GenerateRequest,
            exclude: frozenset[str] = frozenset(),
            pool: str = "",
            since: float = math.inf,
        ) -> Decision | Rejection: ...

        def worker_coming(self, decision: Decision | Rejection) -> bool: ...

        async def place(
            self,
            req: GenerateRequest,
            attempt: int = 1,
            exclude: frozenset[str] = frozenset(),
            migration: Migration | None = None,
            pool: str = "",
            on_accepted: Callable[[], Awaitable[None]] | None = None,
            since: float = math.inf,
        ) -> RouteReason | None: ...

        async def reply_error(self, req: GenerateRequest, r: Rejection) -> None: ...

        def stream_subject(self, req: GenerateRequest) -> str: ...

    async def worker_lost(self, worker_id: str) -> None:
        """``worker_id`` stopped beating: move each request it held to another worker."""
        for w in self.watch.on_worker_lost(worker_id):
            if self.watch.streamed_unannounced(w):
                continue
            await self.move(w, worker_id)

    async def stalled_streams(self) -> None:
        """Move requests whose stream went silent past ``router.stall_timeout_s`` although
        their worker still beats (a hung engine thread, a wedged request)."""
        if self.cfg.stall_timeout_s <= 0:
            return
        for w in self.watch.stalled(self.cfg.stall_timeout_s):
            if not w.complete:  # its end was probably missed in a reconnect
                await self.watch.forget(w.req.key)
                continue
            if w.route is None or self.watch.streamed_unannounced(w):
                continue
            worker_id = w.route.worker_id
            w.lost.add(worker_id)
            log.warning(
                "stream stalled; moving the request",
                extra=fields(request_id=w.req.request_id, worker_id=worker_id),
            )
            await self.move(w, worker_id, reason="stalled")

    async def move(self, w: Watched, worker_id: str, reason: str = "worker_lost") -> None:
        """Place ``w`` again: from scratch before its first token, else as a migration."""
        rid = w.req.request_id
        refusal = ""
        if w.attempt >= self.cfg.max_attempts:
            refusal = f"{w.attempt} attempts (router.max_attempts)"
        elif w.streamed and w.req.sampling.n > 1:
            refusal = "requests with n > 1 do not migrate"
        elif w.streamed and not w.complete:
            refusal = "the router missed part of its stream in a NATS reconnect"
        if refusal:
            when = "mid-stream" if w.streamed else "before the first token"
            what = "stalled" if reason == "stalled" else "was lost"
            await self.reply_error(
                w.req,
                Rejection(
                    "worker_lost",
                    f"worker {worker_id!r} {what} {when}; {refusal}",
                    retry_after_s=self.fleet.retry_after_s,
                ),
            )
            return
        migration = None
        # Workers that (re)join from now on may take it, the restarted lost one included.
        since = time.monotonic()
        pool = w.route.pool if w.route is not None and w.streamed else ""
        if w.streamed:
            migration = w.migration(worker_id)
            if self.worker_coming(self.decide(w.req, frozenset(w.lost), pool, since)):
                reason = "waiting_for_worker"  # the stream pauses until a worker comes
            marker = Migrated(
                seq=w.last_seq + 1,
                request_id=rid,
                from_worker=worker_id,
                attempt=w.attempt + 1,
                num_tokens=len(w.tokens),
                reason=reason,
            )
            w.last_seq += 1
            await self.nc.publish(self.stream_subject(w.req), encode(marker))
            metrics.MIGRATED.inc()
        else:
            metrics.REPLACED.inc()
        # A worker that was only stalled must not resume a request it no longer owns.
        cancel = CancelRequest(request_id=rid, reason="moved", worker_id=worker_id)
        await self.nc.publish(self.subjects.cancel_key(w.req.key), encode(cancel))
        log.info(
            "migrating request of a lost worker" if migration else "re-placing request",
            extra=fields(
                request_id=rid,
                worker_id=worker_id,
                attempt=w.attempt + 1,
                tokens=len(w.tokens) if migration else None,
            ),
        )
        with self._tracer.start_span(
            "router.migrate" if migration else "router.replace",
            attributes={"strait.request_id": rid},
        ) as span:
            route = await self.place(
                w.req, w.attempt + 1, frozenset(w.lost), migration, pool, since=since
            )
            if route is not None:
                span.set_attributes(span_attributes(route))
