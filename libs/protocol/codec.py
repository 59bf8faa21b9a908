"""Encoding and decoding at the boundary: versions checked, requests validated, typed
``ProtocolError``; the JSON schemas of the public messages.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from libs.engine.checks import check_request
from libs.engine.errors import BackendError, ErrorCode
from libs.protocol.base import PROTOCOL_VERSION, SUPPORTED_VERSIONS, usable_request_id
from libs.protocol.cache import (
    CacheEvent,
    CacheFetch,
    CacheFetchReply,
    CacheLookup,
    CacheLookupReply,
    CacheStore,
)
from libs.protocol.events import DeadLetter, RouteDecision, UsageEvent
from libs.protocol.fleet import (
    AdapterCommand,
    AdapterReply,
    DrainRequest,
    KvEvent,
    PlanDecision,
    RouterBeat,
    WorkerBeat,
    WorkerStarting,
)
from libs.protocol.handoff import (
    HandoffAbort,
    HandoffCommit,
    HandoffOffer,
    HandoffReply,
    HandoffResult,
    StreamOwner,
)
from libs.protocol.requests import (
    Assignment,
    AssignmentAck,
    CancelRequest,
    GenerateRequest,
    ResendRequest,
)
from libs.protocol.stream import StreamMessage

T = TypeVar("T")


_encoder = msgspec.json.Encoder()
_stream_decoder = msgspec.json.Decoder(StreamMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class ProtocolError(ValueError):
    """A message that failed validation; ``code`` is the ErrorMessage code to answer with.
    ``request_id`` is kept only when it is usable as a subject token (else "")."""

    def __init__(self, code: ErrorCode, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.request_id = request_id if usable_request_id(request_id) else ""


def decode(data: bytes, type_: type[T]) -> T:
    """Decode and validate ``data`` as ``type_``; version checked first. Raises ProtocolError."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError("invalid_request", f"not valid JSON: {e}") from None
    request_id = ""
    if isinstance(raw, dict):
        rid = raw.get("request_id")
        request_id = rid if isinstance(rid, str) else ""
        v = raw.get("v", PROTOCOL_VERSION)
        if type(v) is not int or v not in SUPPORTED_VERSIONS:
            raise ProtocolError(
                "unsupported_version",
                f"protocol version {v!r} is not supported (supported: {sorted(SUPPORTED_VERSIONS)})",
                request_id,
            )
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        raise ProtocolError("invalid_request", str(e), request_id) from None


def decode_stream(data: bytes) -> StreamMessage:
    return _stream_decoder.decode(data)


def check_fields(req: GenerateRequest) -> None:
    """``libs.engine.checks.check_request`` on ``req``'s fields (raises BackendError): the one
    call the wire's ``validate_request`` and the gateway's ``checked`` share."""
    check_request(
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        messages=req.messages,
        sampling=req.sampling,
        tools=req.tools,
        tool_choice=req.tool_choice,
        tool_name=req.tool_name,
    )


def validate_request(req: GenerateRequest) -> None:
    """The engine's checks across fields (``libs.engine.checks.check_request``) and a request
    id usable as a subject token. Raises ProtocolError."""
    try:
        check_fields(req)
    except BackendError as e:
        raise ProtocolError(e.code, str(e), req.request_id) from None
    if not usable_request_id(req.request_id):
        raise ProtocolError(
            "invalid_request", "request_id must not contain '.', '*', '>' or whitespace"
        )


PUBLIC_MESSAGES: dict[str, type[Any]] = {
    "GenerateRequest": GenerateRequest,
    "CancelRequest": CancelRequest,
    "ResendRequest": ResendRequest,
    "StreamMessage": StreamMessage,  # type: ignore[dict-item]
    "Assignment": Assignment,
    "AssignmentAck": AssignmentAck,
    "HandoffOffer": HandoffOffer,
    "HandoffReply": HandoffReply,
    "HandoffCommit": HandoffCommit,
    "HandoffResult": HandoffResult,
    "HandoffAbort": HandoffAbort,
    "StreamOwner": StreamOwner,
    "DrainRequest": DrainRequest,
    "AdapterCommand": AdapterCommand,
    "AdapterReply": AdapterReply,
    "WorkerBeat": WorkerBeat,
    "WorkerStarting": WorkerStarting,
    "RouterBeat": RouterBeat,
    "KvEvent": KvEvent,
    "UsageEvent": UsageEvent,
    "RouteDecision": RouteDecision,
    "DeadLetter": DeadLetter,
    "PlanDecision": PlanDecision,
    "CacheLookup": CacheLookup,
    "CacheLookupReply": CacheLookupReply,
    "CacheFetch": CacheFetch,
    "CacheFetchReply": CacheFetchReply,
    "CacheStore": CacheStore,
    "CacheEvent": CacheEvent,
}


def json_schemas() -> dict[str, Any]:
    """JSON schemas of every public message (written to docs/schemas/ by `strait schemas`)."""
    return {name: msgspec.json.schema(t) for name, t in PUBLIC_MESSAGES.items()}
