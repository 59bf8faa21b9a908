"""The wire protocol: every message type that crosses a process boundary, and every subject.

Messages are ``msgspec.Struct``s encoded as JSON. Each top-level message carries ``v`` (the
protocol version); a receiver rejects versions it does not know with a typed ``ErrorMessage``
(``code="unsupported_version"``). Subjects are built from one prefix (settings.nats.subject_prefix,
default ``strait.v1``) by :class:`Subjects`; nothing else in the code base spells a subject.
One package, a module per message family, every name re-exported here so callers import
``from libs.protocol import X`` (the house rule: one place for the wire): ``base`` (``Struct``,
the version, request keys and team names), ``requests`` (``GenerateRequest``, ``Assignment``,
resend, cancel), ``stream`` (a request's stream messages), ``fleet`` (beats, announcements,
KV events, drain, adapters, the planner's decisions), ``handoff`` (prefill → decode),
``events`` (JetStream records: usage, routes, batch lines, dead letters), ``cache`` (the
prefix-cache service and the chunk framing), ``subjects`` (:class:`Subjects`) and ``codec``
(encode, decode and validate, JSON schemas). The engine's own request types live in
``libs/engine/params.py`` and are re-exported here.

Data flow (see docs/architecture.md):

    gateway/client --GenerateRequest--> JetStream <prefix>.requests  (stream STRAIT_REQUESTS)
    router --Assignment (request/reply)--> <prefix>.work.<worker_id>  --AssignmentAck-->
    worker --TokenDelta/Finished/ErrorMessage--> <prefix>.stream.<request_id>   (core NATS)
    anyone --CancelRequest--> <prefix>.cancel.<request_id>
    worker --WorkerBeat--> <prefix>.workers.<pool>.<role>.<worker_id>
    router --RouterBeat--> <prefix>.routers.<router_id>   (requests it holds, for the planner)
    worker --KvEvent--> <prefix>.kv_events.<worker_id>
    services --UsageEvent/RouteDecision--> JetStream <prefix>.events.<kind>  (stream STRAIT_EVENTS)
    any service --DeadLetter--> <prefix>.deadletter   (malformed input with no reply subject)
    planner --PlanDecision--> <prefix>.planner.decision.<pool>.<role>  (actuators)
    prefill --CacheLookup/CacheFetch/CacheStore--> <prefix>.cache.{lookup,fetch,store}
    cache --CacheEvent--> JetStream <prefix>.cache.events  (stream STRAIT_CACHE_EVENTS)
    gateway --BatchLine--> JetStream <prefix>.batch.<batch_id>  (stream STRAIT_BATCH) --> batch runner
"""

from __future__ import annotations

from libs.engine.checks import check_request
from libs.engine.errors import BackendError, ErrorCode
from libs.engine.params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_PREDICTION_CHARS,
    ChatMessage,
    FinishReason,
    LogprobEntry,
    Priority,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from libs.protocol.base import (
    MAX_REQUEST_ID_CHARS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    TEAM_NAME,
    Struct,
    request_key,
    usable_request_id,
    valid_team,
)
from libs.protocol.cache import (
    CHUNK_HEADER,
    CHUNK_HEADROOM_BYTES,
    TRANSFER_HEADER,
    CacheEvent,
    CacheFetch,
    CacheFetchAnswer,
    CacheFetchReply,
    CacheLookup,
    CacheLookupAnswer,
    CacheLookupReply,
    CacheMissReason,
    CacheStore,
)
from libs.protocol.codec import (
    PUBLIC_MESSAGES,
    ProtocolError,
    check_fields,
    decode,
    decode_stream,
    encode,
    json_schemas,
    validate_request,
)
from libs.protocol.events import BatchLine, DeadLetter, RouteDecision, UsageEvent
from libs.protocol.fleet import (
    AdapterCommand,
    AdapterReply,
    DrainRequest,
    KvEvent,
    PlanDecision,
    PlanRole,
    RouterBeat,
    StartStage,
    TeamsChanged,
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
    Migration,
    ResendRequest,
    RouteReason,
)
from libs.protocol.stream import (
    ERROR_HTTP_STATUS,
    ErrorMessage,
    Finished,
    Migrated,
    Routed,
    StreamMessage,
    Timings,
    TokenDelta,
    Usage,
)
from libs.protocol.subjects import Subjects

__all__ = [
    "CHUNK_HEADER",
    "CHUNK_HEADROOM_BYTES",
    "ERROR_HTTP_STATUS",
    "MAX_GRAMMAR_CHARS",
    "MAX_LOGIT_BIAS",
    "MAX_PREDICTION_CHARS",
    "MAX_REQUEST_ID_CHARS",
    "PROTOCOL_VERSION",
    "PUBLIC_MESSAGES",
    "SUPPORTED_VERSIONS",
    "TEAM_NAME",
    "TRANSFER_HEADER",
    "AdapterCommand",
    "AdapterReply",
    "Assignment",
    "AssignmentAck",
    "BackendError",
    "BatchLine",
    "CacheEvent",
    "CacheFetch",
    "CacheFetchAnswer",
    "CacheFetchReply",
    "CacheLookup",
    "CacheLookupAnswer",
    "CacheLookupReply",
    "CacheMissReason",
    "CacheStore",
    "CancelRequest",
    "ChatMessage",
    "DeadLetter",
    "DrainRequest",
    "ErrorCode",
    "ErrorMessage",
    "FinishReason",
    "Finished",
    "GenerateRequest",
    "HandoffAbort",
    "HandoffCommit",
    "HandoffOffer",
    "HandoffReply",
    "HandoffResult",
    "KvEvent",
    "LogprobEntry",
    "Migrated",
    "Migration",
    "PlanDecision",
    "PlanRole",
    "Priority",
    "ProtocolError",
    "ResendRequest",
    "RouteDecision",
    "RouteReason",
    "Routed",
    "RouterBeat",
    "SamplingParams",
    "StartStage",
    "StreamMessage",
    "StreamOwner",
    "Struct",
    "StructuredOutput",
    "Subjects",
    "TeamsChanged",
    "Timings",
    "TokenDelta",
    "TokenLogprob",
    "ToolCall",
    "ToolChoice",
    "ToolFunction",
    "Usage",
    "UsageEvent",
    "WorkerBeat",
    "WorkerStarting",
    "check_fields",
    "check_request",
    "decode",
    "decode_stream",
    "encode",
    "json_schemas",
    "request_key",
    "usable_request_id",
    "valid_team",
    "validate_request",
]
