"""JetStream records: batch lines, usage events, route decisions, dead letters.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from libs.protocol.base import PROTOCOL_VERSION, Struct
from libs.protocol.requests import RouteReason


class BatchLine(Struct, kw_only=True):
    """One line of a Batch API input file (``POST /v1/batches``), on ``Subjects.batch(id)``
    with ``Nats-Msg-Id`` ``<batch_id>:<index>``: the stream keeps one copy however often the
    gateway publishes it, and the batch runner answers it once (its result row is keyed by
    (batch_id, index) in the database; the message is acked after the row is committed)."""

    v: int = PROTOCOL_VERSION
    batch_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    index: Annotated[int, msgspec.Meta(ge=0)]  # 0-based line of the input file
    custom_id: str
    url: str  # the batch's endpoint: "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]  # the line's request body, checked as the endpoint checks a body


class UsageEvent(Struct, kw_only=True):
    """One per request, at its end; the ledger upserts by (``origin``, ``request_id``)."""

    v: int = PROTOCOL_VERSION
    request_id: str
    # GenerateRequest.origin: with request_id, the request's identity (a team account's ids
    # are its own; another team may use the same).
    origin: str | None = None
    api_key_id: str | None = None
    team: str | None = None  # GenerateRequest.team
    pool: str = ""
    model: str = ""
    worker_id: str = ""
    route_code: str = ""
    route_factors: list[str] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queued_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0
    status: Literal["ok", "error", "cancelled"] = "ok"
    error_code: str | None = None
    error: str | None = None
    created_at: float = 0.0
    finished_at: float = msgspec.field(default_factory=time.time)
    source: str = "gateway"


class RouteDecision(Struct, kw_only=True):
    """Published by the router for every decision (observers subscribe durably)."""

    v: int = PROTOCOL_VERSION
    request_id: str
    route: RouteReason
    origin: str | None = None  # GenerateRequest.origin
    decided_at: float = msgspec.field(default_factory=time.time)
    decision_s: float = 0.0


class DeadLetter(Struct, kw_only=True):
    """A message that could not be parsed and had no reply subject to answer on."""

    v: int = PROTOCOL_VERSION
    subject: str
    error: str
    service: str
    payload_head: str = ""  # first bytes, for diagnosis; never the full payload
    ts: float = msgspec.field(default_factory=time.time)
