"""The ledger writer: JetStream usage events -> one ``requests`` row per request, keyed by
(``request_id``, ``origin``): a team account's ids are its own (``GenerateRequest.origin``).

Loop: fetch a batch from the durable pull consumer ``ledger`` on the events stream (filtered to
``Subjects.event("usage")`` and ``Subjects.worker_usage``) → decode (garbage is terminated, never retried) → upsert the batch
in one transaction → ack. A database error naks the batch with a delay, so an outage delays rows
and loses none: the events wait in JetStream. Every gateway replica may run a writer: replicas
bound to the same durable consumer share its messages, and a redelivered event (a lost ack, a
replica that died mid-batch) upserts the same row again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy import and_, bindparam, func, or_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from libs.db import Database
from libs.db.models import RequestRow
from libs.log import fields
from libs.protocol import Subjects, UsageEvent
from libs.settings import Settings
from libs.wire.nats_util import (
    ensure_consumer,
    ensure_stream,
    events_stream_config,
    fleet_regions,
    ledger_stream_config,
)
from libs.wire.pull import FETCH_WAIT_S, PullEndpoint

log = logging.getLogger("strait.ledger")

LEDGER_DURABLE = "ledger"
ACK_WAIT_S = 30.0
MAX_ERROR_CHARS = 2000
MAX_BACKOFF_S = 30.0


def _ts(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC)


def row_values(ev: UsageEvent) -> dict[str, Any]:
    return {
        "request_id": ev.request_id,
        "origin": ev.origin or "",
        "api_key_id": ev.api_key_id,
        "team": ev.team,
        "pool": ev.pool,
        "model": ev.model,
        "worker_id": ev.worker_id,
        "route_code": ev.route_code,
        "route_factors": list(ev.route_factors),
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "cached_tokens": ev.cached_tokens,
        "queued_s": ev.queued_s,
        "ttft_s": ev.ttft_s,
        "total_s": ev.total_s,
        "status": ev.status,
        "error_code": ev.error_code,
        "error": ev.error[:MAX_ERROR_CHARS] if ev.error else ev.error,
        "source": ev.source,
        "created_at": _ts(ev.created_at or ev.finished_at),
        "finished_at": _ts(ev.finished_at),
    }


WORKER_SOURCE = "worker"


def _replaces(new: UsageEvent, old: UsageEvent) -> bool:
    """The row keeps the client side's view (gateway, client library) over the worker's, and
    the later of two events from the same side (a redelivery is equal and harmless)."""
    if (new.source == WORKER_SOURCE) != (old.source == WORKER_SOURCE):
        return old.source == WORKER_SOURCE
    return new.finished_at >= old.finished_at


async def upsert_usage(db: Database, events: list[UsageEvent]) -> None:
    """Insert or update the rows of ``events`` in one transaction (idempotent, in any order):
    a worker's event never replaces a client side's row (the worker publishes its own after
    the stream's end, often after the gateway's), and a row is replaced only by a later event
    from the same side, or by the client side's."""
    if not events:
        return
    # One statement may not touch a row twice (PostgreSQL): one event per request.
    chosen: dict[tuple[str, str], UsageEvent] = {}
    for ev in events:
        key = (ev.request_id, ev.origin or "")
        if key not in chosen or _replaces(ev, chosen[key]):
            chosen[key] = ev
    rows = [row_values(ev) for ev in chosen.values()]
    insert = pg_insert if db.dialect == "postgresql" else sqlite_insert
    stmt = insert(RequestRow).values(rows)
    new, old = stmt.excluded, RequestRow.__table__.c
    new_is_worker = new.source == WORKER_SOURCE
    old_is_worker = old.source == WORKER_SOURCE
    set_: dict[str, Any] = {
        k: stmt.excluded[k] for k in rows[0] if k not in ("request_id", "origin")
    }
    set_["team"] = func.coalesce(new.team, old.team)  # a client side's row keeps the fleet's team
    stmt = stmt.on_conflict_do_update(
        index_elements=[RequestRow.request_id, RequestRow.origin],
        set_=set_,
        where=or_(
            and_(old_is_worker, ~new_is_worker),
            and_(old_is_worker == new_is_worker, new.finished_at >= old.finished_at),
        ),
    )
    # The team is the fleet's word (the router stamps it, the worker reports it): it fills a
    # row whose kept event (a client library's) did not name one.
    teams = [
        {"rid": ev.request_id, "o": ev.origin or "", "t": ev.team}
        for ev in events
        if ev.source == WORKER_SOURCE and ev.team is not None
    ]
    async with db.engine.begin() as conn:
        await conn.execute(stmt)
        if teams:
            await conn.execute(
                update(RequestRow)
                .where(
                    RequestRow.request_id == bindparam("rid"),
                    RequestRow.origin == bindparam("o"),
                    RequestRow.team.is_(None),
                )
                .values(team=bindparam("t")),
                teams,
            )


class LedgerWriter:
    """Runs until ``stop()``; ``written`` / ``failures`` count rows and failed batches."""

    def __init__(self, settings: Settings, js: JetStreamContext, db: Database) -> None:
        self.settings = settings
        self.js = js
        self.db = db
        # The region-less names: with regions, the ledger's stream sources every region's
        # events under them (``ledger_stream_config``).
        subjects = Subjects(settings.nats.subject_prefix)
        # Gateways' and clients' events, and workers' own (the row exists when the gateway or
        # client is gone; otherwise theirs wins, in whichever order they arrive).
        self.subjects = [subjects.event("usage"), subjects.worker_usage]
        self.written = 0
        self.failures = 0
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        stream = self.settings.nats.events_stream
        # Regions: every region's events stream before the stream that sources them. A source
        # whose stream does not exist yet is retried by the server on a back-off that reached
        # minutes in the two-region test (the ledger's stream created 4 s before region b's
        # events stream: none of b's events arrived in 60 s). A region unreachable now is
        # left to its own services and to the server's retries.
        for region in fleet_regions(self.settings.nats):
            with contextlib.suppress(Exception):
                await ensure_stream(self.js, events_stream_config(self.settings.nats, region))
        await ensure_stream(self.js, ledger_stream_config(self.settings.nats))
        await ensure_consumer(
            self.js,
            stream,
            ConsumerConfig(
                durable_name=LEDGER_DURABLE,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=ACK_WAIT_S,
                max_deliver=-1,
                filter_subjects=self.subjects,
                deliver_policy=DeliverPolicy.ALL,
            ),
        )
        psub = await self.js.pull_subscribe_bind(durable=LEDGER_DURABLE, stream=stream)
        # A deleted consumer is retried, not raised: the ledger has no one to restart it.
        self._ep = PullEndpoint("ledger", UsageEvent, psub, log, retry_not_found=True)
        self._task = asyncio.create_task(self.run(), name="ledger-writer")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, FETCH_WAIT_S * 4 + 5)
            except TimeoutError:
                self._task.cancel()
            self._task = None
        await self._ep.close()  # before the connection drains

    async def run(self) -> None:
        backoff = self.settings.database.ledger_retry_s
        while not self._stopping.is_set():
            msgs = await self._ep.fetch(self.settings.database.ledger_batch)
            if not msgs:
                continue
            if await self.write(msgs):
                backoff = self.settings.database.ledger_retry_s
            else:
                await self._sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def write(self, msgs: list[Any]) -> bool:
        """Upsert one fetched batch; False when the database refused it (batch nak'ed)."""
        events, good = [], []
        for m in msgs:
            ev = await self._ep.decode(m)  # one that does not decode is terminated
            if ev is not None:
                events.append(ev)
                good.append(m)
        try:
            await upsert_usage(self.db, events)
        except Exception as e:
            self.failures += 1
            log.warning(
                "ledger write failed; events stay in JetStream",
                extra=fields(events=len(events), error=repr(e)[:300]),
            )
            for m in good:
                await m.nak(delay=self.settings.database.ledger_retry_s)
            return False
        for m in good:
            await m.ack()
        self.written += len(events)
        return True

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass
