"""A request's stream, worker → client on ``stream.<request_id>`` (or its reply subject):
``Routed``, ``TokenDelta``, ``Finished``, ``ErrorMessage``, ``Migrated``.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import msgspec

from libs.engine.errors import ErrorCode
from libs.engine.params import FinishReason, LogprobEntry, ToolCall
from libs.protocol.base import PROTOCOL_VERSION, Struct
from libs.protocol.requests import RouteReason


class Usage(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(Struct):
    queued_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0


class Routed(Struct, tag="routed"):
    """Optional first stream message: where the request landed."""

    seq: int
    request_id: str
    route: RouteReason
    v: int = PROTOCOL_VERSION


class TokenDelta(Struct, tag="delta"):
    """New text of one choice. ``finish_reason`` is set on the last delta of that choice."""

    seq: int
    request_id: str
    index: int = 0  # choice index (n > 1)
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: FinishReason | None = None
    # On the choice's last delta when it ended with tool calls (finish_reason "tool_calls");
    # the choice's text then holds the calls' markup too.
    tool_calls: list[ToolCall] | None = None
    v: int = PROTOCOL_VERSION


class Finished(Struct, tag="finished"):
    """Last message of a successful request, after every choice has finished."""

    seq: int
    request_id: str
    usage: Usage
    model: str = ""
    pool: str = ""
    worker_id: str = ""
    timings: Timings = msgspec.field(default_factory=Timings)
    v: int = PROTOCOL_VERSION


# The HTTP status each typed error maps to at the gateway.
ERROR_HTTP_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "unsupported_version": 400,
    "context_length_exceeded": 413,
    "model_not_found": 404,
    "no_capacity": 503,
    "no_worker": 503,
    "rate_limited": 429,
    "permission_denied": 403,
    "cancelled": 499,
    "timeout": 504,
    "internal_error": 500,
    "worker_lost": 503,
    "over_share": 429,
    "deadline_exceeded": 504,
}


class ErrorMessage(Struct, tag="error"):
    """Last message of a failed request (or the reply to a malformed one)."""

    seq: int
    request_id: str
    code: ErrorCode
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    v: int = PROTOCOL_VERSION


class Migrated(Struct, tag="migrated"):
    """The router moved the request to another worker mid-stream (its worker stopped beating).
    The stream goes on: the next message continues the same choices (no token is repeated or
    skipped, ``seq`` keeps counting). Readers that do not care skip it, as they skip Routed."""

    seq: int
    request_id: str
    from_worker: str
    attempt: int  # the placement attempt that follows (2 = first migration)
    num_tokens: int = 0  # output tokens the stream had carried, kept and not recomputed
    reason: str = "worker_lost"
    v: int = PROTOCOL_VERSION


StreamMessage = Routed | TokenDelta | Finished | ErrorMessage | Migrated
