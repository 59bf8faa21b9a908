"""The batch runner: answers the Batch API's lines from JetStream, each exactly once.

One runs in each gateway process (``batch.runner_enabled``; decision 0024); replicas share
the durable consumer ``batch.durable`` on ``nats.batch_stream``. Per line:

    fetch (at most batch.max_inflight held) → skip if its batch is cancelled/done or the line
    already has a result row → wait for room in the pool (no request waiting, more than
    batch.reserve_slots free slots in the workers' beats) → run it as a ``priority: "batch"``
    request through the fleet (the same CompletionRun as an HTTP request; billed to the
    batch's key) → commit the result row (keyed by batch and line) → ack.

A runner that dies before the commit leaves the line unacked: JetStream gives it to a runner
again after ``batch.ack_wait_s`` (the runner says "in progress" meanwhile while alive); one
that dies between commit and ack has the line redelivered and skipped. A failure a retry can
fix (no worker, no capacity, a timeout, a lost worker) is naked with ``batch.retry_s`` delay,
at most ``batch.max_attempts`` deliveries. The sweep finalizes batches: completed when every
line has a row, cancelled when cancelling and none of its lines runs here, expired past its
window; and publishes again the lines of a batch left ``validating``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

from pydantic import ValidationError

from libs.db.batches import ANY_KEY, DONE, BatchStore
from libs.db.models import BatchRow
from libs.log import fields
from libs.protocol import BatchLine
from libs.settings import Settings
from libs.wire.nats_util import (
    batch_stream_config,
    ensure_consumer,
    ensure_stream,
    work_queue_consumer,
)
from libs.wire.pull import PullEndpoint
from services.gateway.auth import KeyInfo
from services.gateway.batches import publish_lines, unix
from services.gateway.chunks import Kind
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError, validation_api_error
from services.gateway.fleet import Fleet
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.translate import chat_request, fields_of, text_request

log = logging.getLogger("strait.batch")

# Errors a later attempt may not meet: the fleet was short of workers or capacity, or slow.
RETRYABLE = frozenset({429, 503, 504})
RETRYABLE_CODES = frozenset({"worker_lost", "timeout", "no_worker", "no_capacity", "queue_full"})


class BatchRunner:
    def __init__(self, settings: Settings, fleet: Fleet, store: BatchStore) -> None:
        self.settings, self.cfg = settings, settings.batch
        self.fleet, self.store = fleet, store
        self.tasks: set[asyncio.Task[Any]] = set()
        self.lines: set[asyncio.Task[Any]] = set()
        # Lines of each batch running here (a cancelled batch is finalized when none is).
        self.active: Counter[str] = Counter()
        self.room_freed = asyncio.Event()
        self.answered = 0  # lines this runner committed (tests, logs)

    async def start(self) -> None:
        js = self.fleet.js
        assert js is not None
        n = self.settings.nats
        await ensure_stream(js, batch_stream_config(n, self.cfg.window_s, self.cfg.dedupe_window_s))
        await ensure_consumer(
            js,
            n.batch_stream,
            work_queue_consumer(
                self.cfg.durable, [self.fleet.subjects.batch_all], self.cfg.ack_wait_s
            ),
        )
        psub = await js.pull_subscribe_bind(self.cfg.durable, n.batch_stream)
        self.pull = PullEndpoint("batch.lines", BatchLine, psub, log, wait_s=self.cfg.fetch_wait_s)
        self._spawn(self.fetch_loop(), self.tasks)
        self._spawn(self.sweep_loop(), self.tasks)

    async def stop(self) -> None:
        """Stop at once: lines running here are left unacked (another runner takes them)."""
        for t in [*self.tasks, *self.lines]:
            t.cancel()
        await asyncio.gather(*self.tasks, *self.lines, return_exceptions=True)
        await self.pull.close()

    def _spawn(self, coro: Any, into: set[asyncio.Task[Any]]) -> None:
        t = asyncio.create_task(coro)
        into.add(t)
        t.add_done_callback(into.discard)

    # ------------------------------------------------------------ receive

    async def fetch_loop(self) -> None:
        while True:
            free = self.cfg.max_inflight - len(self.lines)
            if free <= 0:
                self.room_freed.clear()
                await self.room_freed.wait()
                continue
            for m in await self.pull.fetch(free):
                self._spawn(self.line(m), self.lines)

    async def line(self, msg: Any) -> None:
        line = await self.pull.decode(msg)
        if line is None:  # logged and terminated
            return
        self.active[line.batch_id] += 1
        keepalive = asyncio.create_task(self._keepalive(msg))
        try:
            await self.handle(line, msg)
        except Exception:
            # The database or NATS failed: leave the line for a redelivery.
            log.exception(
                "batch line failed", extra=fields(batch_id=line.batch_id, line=line.index)
            )
        finally:
            keepalive.cancel()
            self.active[line.batch_id] -= 1
            if self.active[line.batch_id] <= 0:
                del self.active[line.batch_id]
            self.room_freed.set()

    async def _keepalive(self, msg: Any) -> None:
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def handle(self, line: BatchLine, msg: Any) -> None:
        # Two database sessions a line: its state, then its answer (which says whether the
        # batch is complete): each costs CPU on the machine interactive requests run on.
        batch, answered = await self.store.line_state(line.batch_id, line.index)
        if batch is None or batch.status in DONE or batch.status == "cancelling":
            await msg.ack()
            return
        if answered:
            await msg.ack()  # answered before; only its ack was lost
            await self.maybe_complete(line.batch_id)
            return
        attempt = msg.metadata.num_delivered
        ok, result, retry = await self.answer(line, batch, attempt)
        if retry and attempt < self.cfg.max_attempts:
            await msg.nak(delay=self.cfg.retry_s)
            return
        stored, complete = await self.store.record(line.batch_id, line.index, ok, result)
        if stored:
            self.answered += 1
        await msg.ack()
        if complete or not stored:
            await self.maybe_complete(line.batch_id)

    # ------------------------------------------------------------ run

    async def answer(
        self, line: BatchLine, batch: BatchRow, attempt: int
    ) -> tuple[bool, dict[str, Any], bool]:
        """Run one line: (ok, its output or error file line, whether a retry may succeed)."""
        hex_id = line.batch_id.removeprefix("batch_")
        request_id = f"batchreq_{hex_id}_{line.index}_{attempt}"
        key = KeyInfo(key_id=batch.api_key_id or "", name="batch", team=batch.team)
        try:
            kind, body = self.parse(line)
            req = (
                chat_request(body, key, request_id, "batch")
                if isinstance(body, ChatCompletionRequest)
                else text_request(body, key, request_id, "batch")
            )
            await self.wait_for_room(req.model)
            run = CompletionRun(self.fleet, kind, req, key.key_id, False, fields=fields_of(body))
            try:
                first = await run.start()
            except BaseException:
                await asyncio.shield(run.close())
                raise
            out = await run.collect(first)
        except ApiError as e:
            retry = e.status in RETRYABLE or e.code in RETRYABLE_CODES
            return False, self.result(line, request_id, e.status, e.body()), retry
        return True, self.result(line, request_id, 200, out), False

    def parse(self, line: BatchLine) -> tuple[Kind, ChatCompletionRequest | CompletionRequest]:
        """The line's body, checked as its endpoint checks one; a 400 otherwise."""
        model = ChatCompletionRequest if line.url == "/v1/chat/completions" else CompletionRequest
        try:
            body = model.model_validate(line.body)
        except ValidationError as e:
            raise validation_api_error(list(e.errors())) from None
        if body.stream:
            raise ApiError(
                400, "stream is not supported in a batch", "unsupported_parameter", "stream"
            )
        if "priority" in body.model_fields_set and body.priority != "batch":
            raise ApiError(
                400,
                "a batch's lines run as priority 'batch'; send interactive requests directly",
                "unsupported_parameter",
                "priority",
            )
        return ("chat" if model is ChatCompletionRequest else "text"), body

    def result(
        self, line: BatchLine, request_id: str, status: int, body: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.index}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }

    def room(self, model: str) -> bool:
        """Interactive traffic leaves room in ``model``'s pools: nothing waits in them and more
        than ``batch.reserve_slots`` slots are free. No live worker: let the router decide
        (it waits for one coming back, or answers no_worker and the line is retried)."""
        workers = [w for p in self.fleet.pools_for(model) for w in self.fleet.registry.live(p)]
        if not workers:
            return True
        waiting = sum(w.beat.waiting for w in workers)
        free = sum(max(w.beat.capacity - w.beat.running, 0) for w in workers)
        return waiting == 0 and free > self.cfg.reserve_slots

    async def wait_for_room(self, model: str) -> None:
        while True:
            if self.room(model):
                return
            await asyncio.sleep(self.cfg.room_poll_s)

    # ------------------------------------------------------------ finalize

    async def maybe_complete(self, batch_id: str) -> None:
        b = await self.store.get_batch(batch_id, ANY_KEY)
        if b is not None and b.status == "in_progress" and b.completed + b.failed >= b.total:
            if await self.store.finalize(batch_id, "completed", ["in_progress"]):
                log.info(
                    "batch completed",
                    extra=fields(batch_id=batch_id, completed=b.completed, failed=b.failed),
                )

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                await self.sweep()
            except Exception as e:
                log.warning("batch sweep failed", extra=fields(error=repr(e)))

    async def sweep(self) -> None:
        now = time.time()
        for b in await self.store.batches_in(["validating", "in_progress", "cancelling"]):
            if b.status == "cancelling" and self.active.get(b.id, 0) == 0:
                await self.store.finalize(b.id, "cancelled", ["cancelling"])
            elif b.status == "in_progress":
                if b.completed + b.failed >= b.total:
                    await self.maybe_complete(b.id)
                elif now > b.body.get("expires_at", now + 1):
                    await self.store.finalize(b.id, "expired", ["in_progress"])
            elif (
                b.status == "validating"
                and now - unix(b.created_at) > self.cfg.republish_after_s
                and self.fleet.js is not None
            ):
                log.info("publishing a batch's lines again", extra=fields(batch_id=b.id))
                await publish_lines(self.fleet.js, self.settings, self.store, b)
