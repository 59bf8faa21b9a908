"""The KV handoff between a disaggregated pool's prefill and decode workers.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import msgspec

from libs.engine.params import LogprobEntry
from libs.protocol.base import PROTOCOL_VERSION, Struct
from libs.protocol.requests import Assignment

# States of one handoff, driven by the prefill worker (services/prefill/handoff.py) and
# answered by the decode worker (services/decode/handoff.py):
#
#   offer ──HandoffOffer (request/reply)──► decode: room? ──HandoffReply(accepted=False)──► next
#     │                                                    (refused: draining / full / too big)
#     ▼ accepted (decode reserves a slot until handoff.reservation_ttl_s; says how many leading
#     │          offered blocks it already holds: only the rest are sent)
#   blocks ──raw KV chunks (core NATS) on reply.kv_subject, CHUNK_HEADER = index 0..n-1──►
#     ▼
#   commit ──HandoffCommit (request/reply)──► decode: all chunks? import, admit
#     │                                        ──HandoffResult(ok)──► prefill forgets its copy
#     ▼ no/failed answer: prefill publishes HandoffAbort, then tries the next decode worker or
#       ends the request's stream with an ErrorMessage (never a silent success)
#
# The decode worker drops a reservation that is not committed in time, and frees everything of
# a transfer it aborts; after a successful commit it alone writes the request's stream.


class HandoffOffer(Struct, kw_only=True):
    """Prefill worker → ``Subjects.handoff_offer(decode_worker_id)``; reply: HandoffReply."""

    v: int = PROTOCOL_VERSION
    transfer_id: str
    assignment: Assignment
    prefill_worker_id: str
    prompt_token_ids: list[int]  # as the prefill worker tokenized them (no re-tokenizing)
    # Sampled by the prefill worker with the request's sampling params; None when the request
    # has n > 1 choices (the decode worker samples every first token itself).
    first_token_id: int | None = None
    first_logprobs: LogprobEntry | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill side served from a prefix cache
    # Chain hashes of the prompt's full blocks the prefill side can send, in prefix order; the
    # decode side computes whatever they do not cover.
    block_hashes: list[int] = msgspec.field(default_factory=list)
    kv_bytes: int = 0  # bytes of all of them (the decode side may need fewer)
    next_seq: int = 1  # the decode worker's first stream message gets this seq
    prefill_s: float = 0.0  # prefill worker: assignment → first token


class HandoffReply(Struct):
    v: int = PROTOCOL_VERSION
    accepted: bool = False
    reason: str = ""  # refused: "draining" | "full" | "too_large" | "duplicate" | error text
    kv_subject: str = ""  # where to publish the KV chunks
    # Leading offered blocks the decode worker already holds in its prefix cache: the prefill
    # side sends only the blocks after them.
    cached_blocks: int = 0


class HandoffCommit(Struct, kw_only=True):
    """Prefill → ``Subjects.handoff_commit(decode_worker_id)`` once every chunk is published;
    reply: HandoffResult."""

    v: int = PROTOCOL_VERSION
    transfer_id: str
    request_id: str
    origin: str | None = None  # GenerateRequest.origin
    kv_blocks: int = 0  # blocks sent (after HandoffReply.cached_blocks)
    kv_bytes: int = 0
    kv_chunks: int = 0  # chunk messages published before this commit


class HandoffResult(Struct):
    v: int = PROTOCOL_VERSION
    ok: bool = False
    reason: str = ""  # failed: "unknown_transfer" | "missing_chunks" | "bad_blocks: …"


class StreamOwner(Struct, kw_only=True):
    """Decode worker → ``Subjects.stream_owner`` (core NATS) when it admits a handoff: it writes
    the request's stream from now on. The router's watch follows it, so that the decode
    worker's loss moves the request (a migration through a prefill worker)."""

    v: int = PROTOCOL_VERSION
    request_id: str
    worker_id: str
    origin: str | None = None  # GenerateRequest.origin


class HandoffAbort(Struct, kw_only=True):
    """Prefill → ``Subjects.handoff_abort(decode_worker_id)``: forget this transfer."""

    v: int = PROTOCOL_VERSION
    transfer_id: str
    request_id: str
    reason: str = ""
    origin: str | None = None  # GenerateRequest.origin
