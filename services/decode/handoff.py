"""The decode side of a KV handoff (disaggregated pools; protocol in
libs/protocol/handoff.py).

Used by a decode worker (``services.decode.worker``; ``services.decode.main`` starts it): it
subscribes :meth:`on_offer`, :meth:`on_kv`, :meth:`on_commit` and :meth:`on_abort` on this
worker's handoff subjects, and runs :meth:`sweep_loop`. Per transfer:

    offer   → refuse (draining / full / too large / duplicate) or reserve a slot until
              ``handoff.reservation_ttl_s`` and answer with the subject for the KV chunks and
              how many leading offered blocks this engine already holds (not sent again)
    chunks  → buffered in memory (bytes only; no engine blocks are taken yet)
    commit  → the count of chunks sent; all here? decode the blocks, import them into the
              engine's prefix cache, start the request (``DecodeWorker.serve_handoff``)
    abort   → forget the transfer; if the request already started here, cancel it (the prefill
              side gave up on it and tells the client)

A reservation that is never committed is dropped by the sweep, so a prefill worker that dies
mid-handoff strands nothing here; imported blocks are ordinary free cached blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from libs.backend import BackendError
from libs.engine.async_engine import AsyncEngineBackend
from libs.engine.kv_manager import blocks_for
from libs.engine.kv_transfer import decode as decode_kv
from libs.log import fields
from libs.protocol import (
    CHUNK_HEADER,
    HandoffAbort,
    HandoffCommit,
    HandoffOffer,
    HandoffReply,
    HandoffResult,
    StreamOwner,
    encode,
    request_key,
)
from libs.telemetry import extract_context
from services.decode.worker import DecodeWorker
from services.endpoint import Endpoint, answers_or_dead_letters, dead_letters
from services.worker import metrics

log = logging.getLogger("strait.handoff")


@dataclass
class _Transfer:
    offer: HandoffOffer
    deadline: float  # time.monotonic()
    chunks: dict[int, bytes] = field(default_factory=dict)  # index → raw chunk
    expected: int | None = None  # chunk count, known from the commit
    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, index: int, data: bytes) -> None:
        self.chunks.setdefault(index, data)
        self._check()

    def expect(self, n: int) -> None:
        self.expected = n
        self._check()

    def _check(self) -> None:
        if self.expected is not None and all(i in self.chunks for i in range(self.expected)):
            self.complete.set()


class HandoffReceiver:
    def __init__(self, worker: DecodeWorker, engine: AsyncEngineBackend) -> None:
        self.worker = worker
        self.nc = worker.nc
        self.subjects = worker.subjects
        self.cfg = worker.settings.handoff
        self.engine = engine  # the worker's backend: prefix-cache queries and imports
        self.transfers: dict[str, _Transfer] = {}
        # request id → transfer id of requests started here from a handoff
        self.started: dict[str, str] = {}

    async def subscribe(self) -> list[Subscription]:
        wid = self.worker.worker_id
        # KV chunks arrive in bursts; a pending limit in bytes large enough for several
        # prompts' blocks keeps nats-py from dropping them as a slow consumer.
        pending = 64 * self.worker.settings.nats.max_payload
        nc, subjects = self.nc, self.subjects
        offer = Endpoint(
            "decode.handoff_offer",
            HandoffOffer,
            self.on_offer,
            answers_or_dead_letters(
                nc,
                subjects,
                "decode",
                lambda e: HandoffReply(accepted=False, reason=str(e)),
                "bad handoff offer: ",
            ),
        )
        commit = Endpoint(
            "decode.handoff_commit",
            HandoffCommit,
            self.on_commit,
            answers_or_dead_letters(
                nc,
                subjects,
                "decode",
                lambda e: HandoffResult(ok=False, reason=str(e)),
                "bad handoff commit: ",
            ),
        )
        abort = Endpoint(
            "decode.handoff_abort",
            HandoffAbort,
            self.on_abort,
            dead_letters(nc, subjects, "decode"),
        )
        return [
            await offer.subscribe(nc, subjects.handoff_offer(wid)),
            # Raw KV chunks, no message to decode: hand-written (on_kv).
            await nc.subscribe(
                subjects.handoff_kv_all(wid), cb=self.on_kv, pending_bytes_limit=pending
            ),
            await commit.subscribe(nc, subjects.handoff_commit(wid)),
            await abort.subscribe(nc, subjects.handoff_abort(wid)),
        ]

    # ------------------------------------------------------------ offer

    def _refusal(self, offer: HandoffOffer) -> str:
        w = self.worker
        key = offer.assignment.request.key
        if w.draining:
            return "draining"
        if offer.transfer_id in self.transfers or key in w.tasks:
            return "duplicate"
        if len(w.tasks) + len(self.transfers) >= w.settings.worker.max_waiting + w.load_capacity():
            return "full"
        total = len(offer.prompt_token_ids) + offer.assignment.request.sampling.max_tokens
        if blocks_for(total, w.backend.load().block_size) > self.engine.num_kv_blocks:
            return "too_large"
        return ""

    async def on_offer(self, offer: HandoffOffer, msg: Msg) -> HandoffReply:
        reason = self._refusal(offer)
        rid = offer.assignment.request.request_id
        if reason:
            metrics.HANDOFFS.labels(side="decode", outcome=f"refused_{reason}").inc()
            log.info(
                "handoff refused",
                extra=fields(request_id=rid, transfer_id=offer.transfer_id, reason=reason),
            )
            return HandoffReply(accepted=False, reason=reason)
        self.transfers[offer.transfer_id] = _Transfer(
            offer, time.monotonic() + self.cfg.reservation_ttl_s
        )
        kv_subject = self.subjects.handoff_kv(self.worker.worker_id, offer.transfer_id)
        have = self.engine.cached_prefix_blocks(offer.block_hashes)
        return HandoffReply(accepted=True, kv_subject=kv_subject, cached_blocks=have)

    # ------------------------------------------------------------ chunks

    async def on_kv(self, msg: Msg) -> None:
        transfer_id = msg.subject.rsplit(".", 1)[-1]
        t = self.transfers.get(transfer_id)
        if t is None:  # aborted, expired or never offered: drop it
            metrics.HANDOFF_CHUNKS_DROPPED.inc()
            return
        try:
            index = int((msg.headers or {}).get(CHUNK_HEADER, ""))
        except ValueError:
            metrics.HANDOFF_CHUNKS_DROPPED.inc()
            return
        t.add(index, msg.data)  # repeated: the first copy stays

    # ------------------------------------------------------------ commit

    async def on_commit(self, c: HandoffCommit, msg: Msg) -> HandoffResult:
        t = self.transfers.get(c.transfer_id)
        if t is None:
            return HandoffResult(ok=False, reason="unknown_transfer")
        # Chunks and the commit travel on different subscriptions: give the last chunks a
        # moment to be dispatched before calling them missing.
        t.expect(c.kv_chunks)
        try:
            await asyncio.wait_for(t.complete.wait(), max(t.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            pass
        if self.transfers.pop(c.transfer_id, None) is None:  # aborted meanwhile
            return HandoffResult(ok=False, reason="unknown_transfer")
        result = await self._admit(t, c, extract_context(msg.headers))
        outcome = "ok" if result.ok else "failed"
        metrics.HANDOFFS.labels(side="decode", outcome=outcome).inc()
        return result

    async def _admit(self, t: _Transfer, c: HandoffCommit, parent: Context) -> HandoffResult:
        offer = t.offer
        req = offer.assignment.request
        rid, key = req.request_id, req.key
        if not t.complete.is_set():
            missing = sum(1 for i in range(c.kv_chunks) if i not in t.chunks)
            return HandoffResult(ok=False, reason=f"missing_chunks: {missing} of {c.kv_chunks}")
        if c.kv_chunks:
            try:
                # One copy: the chunks into a bytearray the imported tensor reads in place.
                kv = decode_kv(bytearray().join(t.chunks[i] for i in range(c.kv_chunks)))
                await self.engine.import_prefix(kv)
            except (ValueError, BackendError) as e:
                return HandoffResult(ok=False, reason=f"bad_blocks: {e}")
            metrics.HANDOFF_BYTES.labels(side="decode").inc(c.kv_bytes)
        if key in self.worker.recently_cancelled:
            return HandoffResult(ok=False, reason="cancelled")
        if self.worker.draining or key in self.worker.tasks:
            return HandoffResult(
                ok=False, reason="draining" if self.worker.draining else "duplicate"
            )
        self.started[key] = offer.transfer_id
        task = self.worker.start_task(req, self.worker.serve_handoff(offer, parent))
        task.add_done_callback(lambda _: self.started.pop(key, None))
        owner = StreamOwner(request_id=rid, origin=req.origin, worker_id=self.worker.worker_id)
        await self.worker.nc.publish(self.worker.subjects.stream_owner, encode(owner))
        log.info(
            "handoff admitted",
            extra=fields(
                request_id=rid,
                transfer_id=offer.transfer_id,
                blocks=c.kv_blocks,
                bytes=c.kv_bytes,
                prefill_worker=offer.prefill_worker_id,
            ),
        )
        return HandoffResult(ok=True)

    # ------------------------------------------------------------ abort and expiry

    async def on_abort(self, a: HandoffAbort, msg: Msg) -> None:
        self.transfers.pop(a.transfer_id, None)
        key = request_key(a.origin, a.request_id)
        if self.started.get(key) == a.transfer_id:
            task = self.worker.tasks.get(key)
            self.worker.backend.abort(key)
            if task is not None:
                task.cancel()
        metrics.HANDOFFS.labels(side="decode", outcome="aborted").inc()
        log.info(
            "handoff aborted",
            extra=fields(request_id=a.request_id, transfer_id=a.transfer_id, reason=a.reason),
        )

    def sweep(self, now: float | None = None) -> int:
        """Drop reservations past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [tid for tid, t in self.transfers.items() if t.deadline <= now]
        for tid in expired:
            t = self.transfers.pop(tid)
            metrics.HANDOFFS.labels(side="decode", outcome="expired").inc()
            log.warning(
                "handoff reservation expired",
                extra=fields(request_id=t.offer.assignment.request.request_id, transfer_id=tid),
            )
        return len(expired)

    async def sweep_loop(self, stopping: asyncio.Event) -> None:
        interval = max(self.cfg.reservation_ttl_s / 4, 0.05)
        while not stopping.is_set():
            self.sweep()
            try:
                await asyncio.wait_for(stopping.wait(), interval)
            except TimeoutError:
                continue
