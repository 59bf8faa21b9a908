"""The prefill side of a KV handoff (the decode side: services/decode/handoff.py; the
protocol in libs/protocol/handoff.py).

A :class:`PrefillWorker` whose request goes on past its first token calls
:meth:`HandoffSender.hand_off`: the request is offered to the decode workers of
``Assignment.decode_workers`` in order (at most ``handoff.max_offers``), each attempt

    offer (request/reply) → refused? next → KV chunks (only the blocks the decode worker does
    not hold) → commit (request/reply) → ok: the decode worker owns the stream

and whatever fails after an accepted offer (no answer, a failed commit, the client's cancel)
sends the decode side a ``HandoffAbort``, so it drops the transfer and the request.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import trace

from libs.backend import BackendError, PreparedPrompt
from libs.engine.async_engine import PrefillResult
from libs.engine.kv_transfer import KvBlocks, split, tail
from libs.engine.kv_transfer import encode as encode_kv
from libs.protocol import (
    Assignment,
    HandoffAbort,
    HandoffCommit,
    HandoffOffer,
    HandoffReply,
    HandoffResult,
    Usage,
    encode,
)
from libs.telemetry import inject_headers
from libs.wire.kv_cache_client import chunk_limit
from libs.wire.nats_util import publish_chunks
from libs.wire.stream_writer import StreamWriter
from services.worker import metrics
from services.worker.base import Worker


class HandoffSender:
    """One prefill worker's offers to decode workers, over its connection and subjects."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.nc = worker.nc
        self.subjects = worker.subjects
        self.tracer = worker._tracer
        self.cfg = worker.settings.handoff
        self.retry_after_s = worker.settings.fleet.retry_after_s
        self.chunk_bytes = chunk_limit(worker.nc, worker.settings, self.cfg.chunk_bytes)

    async def hand_off(
        self,
        a: Assignment,
        out: StreamWriter,
        prompt: PreparedPrompt,
        res: PrefillResult,
        usage: Usage,
        prefill_s: float,
        parent_span: trace.Span,
    ) -> str:
        """Offer the request to the decode workers in order; returns the one that committed.
        Raises BackendError when none did (the caller tells the client)."""
        kv = res.kv
        c = res.chunk
        reasons: list[str] = []
        for decode_id in a.decode_workers[: self.cfg.max_offers]:
            offer = HandoffOffer(
                transfer_id=uuid.uuid4().hex,
                assignment=a,
                prefill_worker_id=self.worker.worker_id,
                prompt_token_ids=prompt.token_ids,
                first_token_id=None if a.request.sampling.n > 1 else c.token_ids[0],
                first_logprobs=c.logprobs[0] if c.logprobs and a.request.sampling.n == 1 else None,
                num_cached_tokens=usage.cached_tokens,
                block_hashes=kv.header.block_hashes if kv is not None else [],
                kv_bytes=kv.data.numel() * kv.data.element_size() if kv is not None else 0,
                next_seq=out.peek_seq(),  # the decode worker's first message
                prefill_s=prefill_s,
            )
            ctx = trace.set_span_in_context(parent_span)
            with self.tracer.start_as_current_span(
                "kv_handoff",
                context=ctx,
                attributes={
                    "strait.decode_worker_id": decode_id,
                    "strait.offered_blocks": len(offer.block_hashes),
                },
            ) as span:
                t0 = time.perf_counter()
                reason, sent = await self._try(decode_id, offer, kv)
                span.set_attributes(
                    {
                        "strait.handoff_s": time.perf_counter() - t0,
                        "strait.kv_blocks": sent.kv_blocks,
                        "strait.kv_bytes": sent.kv_bytes,
                        "strait.kv_chunks": sent.kv_chunks,
                    }
                )
                if not reason:
                    metrics.HANDOFFS.labels(side="prefill", outcome="ok").inc()
                    metrics.HANDOFF_BYTES.labels(side="prefill").inc(sent.kv_bytes)
                    metrics.HANDOFF_SECONDS.observe(time.perf_counter() - t0)
                    return decode_id
                span.set_status(trace.StatusCode.ERROR, reason)
                metrics.HANDOFFS.labels(side="prefill", outcome="failed").inc()
                reasons.append(f"{decode_id}: {reason}")
        raise BackendError(
            "no_capacity",
            "no decode worker took the request (" + "; ".join(reasons) + ")",
            retry_after_s=self.retry_after_s,
        )

    async def _try(
        self, decode_id: str, offer: HandoffOffer, kv: KvBlocks | None
    ) -> tuple[str, HandoffCommit]:
        """One handoff attempt: ("" or why it failed, what was sent). Only the blocks after
        those the decode worker already holds are sent. Whatever fails after the offer was
        accepted, the decode side is told to forget the transfer."""
        timeout = self.cfg.request_timeout_s
        req = offer.assignment.request
        rid, origin = req.request_id, req.origin
        commit = HandoffCommit(transfer_id=offer.transfer_id, request_id=rid, origin=origin)
        reply = await self._request(self.subjects.handoff_offer(decode_id), offer, timeout)
        if reply is None:
            return "no answer to the offer", commit
        try:
            accepted = msgspec.json.decode(reply, type=HandoffReply)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed answer to the offer", commit
        if not accepted.accepted:
            return f"refused: {accepted.reason}", commit
        rest = tail(kv, accepted.cached_blocks) if kv is not None else None
        payload = encode_kv(rest) if rest is not None else b""
        pieces = split(payload, self.chunk_bytes) if payload else []
        commit.kv_blocks = len(rest.header.block_hashes) if rest is not None else 0
        commit.kv_bytes, commit.kv_chunks = len(payload), len(pieces)
        try:
            await publish_chunks(self.nc, accepted.kv_subject, pieces, {})
            raw = await self._request(self.subjects.handoff_commit(decode_id), commit, timeout)
            result = msgspec.json.decode(raw, type=HandoffResult) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            result = None
        except asyncio.CancelledError:  # the client cancelled mid-handoff: release the decode side
            abort = HandoffAbort(
                transfer_id=offer.transfer_id, request_id=rid, origin=origin, reason="cancelled"
            )
            await self.nc.publish(self.subjects.handoff_abort(decode_id), encode(abort))
            raise
        if result is not None and result.ok:
            return "", commit
        why = result.reason if result is not None else "no answer to the commit"
        # The decode side may have started the request and only the answer was lost: tell it
        # to drop the transfer (and the request, if it started it) before anyone else runs it.
        abort = HandoffAbort(
            transfer_id=offer.transfer_id, request_id=rid, origin=origin, reason=why
        )
        await self.nc.publish(self.subjects.handoff_abort(decode_id), encode(abort))
        return why, commit

    async def _request(self, subject: str, msg: msgspec.Struct, timeout: float) -> bytes | None:
        try:
            reply = await self.nc.request(
                subject, encode(msg), timeout=timeout, headers=inject_headers()
            )
        except (NatsTimeout, NoRespondersError, TimeoutError):
            return None
        return reply.data
