"""The wire protocol: every message type that crosses a process boundary, and every subject.

Messages are ``msgspec.Struct``s encoded as JSON. Each top-level message carries ``v`` (the
protocol version); a receiver rejects versions it does not know with a typed ``ErrorMessage``
(``code="unsupported_version"``). Subjects are built from one prefix (settings.nats.subject_prefix,
default ``strait.v1``) by :class:`Subjects`; nothing else in the code base spells a subject.
Over 500 lines by design: every message and subject of the fleet in one module (the house
rule), so a reader of the wire has one place to look; the engine's own request types live in
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

import re
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec

# The engine owns a request's types and the codes a request fails with (libs/engine/params.py,
# errors.py); the wire embeds them and re-exports them for the fleet.
from libs.engine.checks import check_request
from libs.engine.errors import BackendError, ErrorCode
from libs.engine.params import (  # noqa: F401
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

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

T = TypeVar("T")


class Struct(msgspec.Struct, forbid_unknown_fields=False):
    """Base for wire types: unknown fields are ignored (forward compatible within a version)."""


# ---------------------------------------------------------------- requests


class GenerateRequest(Struct, kw_only=True):
    """Published by the gateway or an internal client on ``Subjects.requests``.

    Exactly one of ``prompt``, ``prompt_token_ids`` or ``messages`` is set. ``reply_subject``
    is where the worker streams; the publisher subscribes to it *before* publishing.
    """

    v: int = PROTOCOL_VERSION
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    model: str = "auto"  # a pool name, a model name, or "auto"
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: Priority = "interactive"
    reply_subject: str = ""  # empty: Subjects.stream(request_id)
    api_key_id: str | None = None
    # The team (NATS account, docs/security.md) the request is billed and limited as. Set by
    # the fleet, never believed from a team: the router overwrites it (and ``reply_subject``)
    # from the subject a team's request arrived on (``Subjects.team_requests``); the gateway
    # sets it from the API key's team.
    team: str | None = None
    # The team account the request came in through (``Subjects.team_requests``), written by the
    # router from the subject, never believed from the payload; None: the fleet's own account
    # (the gateway, internal clients). A request is identified by (origin, request_id): each
    # team chooses its own ids, so two teams may use the same one (``request_key``).
    origin: str | None = None
    user: str | None = None
    # The tenant's terms in flow control (docs/flow-control.md), set by the fleet, never
    # believed from a team: the gateway from the API key, the router from the teams file for
    # a team's request. Weight in the fair share of tokens (None: 1); most requests of the
    # tenant that may wait in a pool before it answers over_share (None: flow.max_waiting).
    tenant_weight: Annotated[float, msgspec.Meta(gt=0)] | None = None
    tenant_max_waiting: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # Seconds the request may wait for a worker to take it (from created_at) before it ends
    # with deadline_exceeded; None: flow.queue_timeout_s.
    queue_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    created_at: float = msgspec.field(default_factory=time.time)  # unix seconds
    # Extra stream messages: echo the chosen route before the first token.
    want_route: bool = False
    # Functions the model may call (rendered by the model's chat template, or by Strait's
    # fallback when the template has no tool format). tool_choice "required" or tool_name
    # makes the worker's grammar engine force calls; "auto" parses calls the model chose to
    # make; "none" never reports calls. Calls arrive on a choice's last TokenDelta.
    tools: Annotated[list[ToolFunction], msgspec.Meta(max_length=128)] | None = None
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # force a call of this function (OpenAI's named tool_choice)
    parallel_tool_calls: bool = True

    @property
    def key(self) -> str:
        """The request's identity inside the fleet: ``request_key(origin, request_id)``."""
        return request_key(self.origin, self.request_id)


class RouteReason(Struct):
    """Why the router put a request where it did; lands in ledger, trace and metrics."""

    pool: str
    worker_id: str
    code: str  # e.g. "explicit_pool", "explicit_model", "auto_small", "auto_large", "spill_over"
    score: float | None = None  # difficulty score when classified
    factors: list[str] = msgspec.field(default_factory=list)
    overlap_blocks: int = 0
    cost: float | None = None
    # The worker's region ("": a fleet of one region). A placement outside the router's own
    # region says why in ``cross_region``: "no_local_worker" (none live in the pool there) or
    # "local_saturated" (every one at router.saturation_load); "" for a local one.
    region: str = ""
    cross_region: str = ""


class Migration(Struct, kw_only=True):
    """What a request's stream already carried when its worker was lost (router → the next
    worker, on ``Assignment.migration``). The next worker recomputes prompt + these tokens,
    replays them through its detokenizer, grammar, penalty and seeded-sampler state without
    reporting them again, and continues the stream at ``next_seq``."""

    from_worker: str
    output_token_ids: list[int] = msgspec.field(default_factory=list)  # choice 0's, in order
    output_text: str = ""  # the text those tokens streamed (tool-call parsing needs it)
    finished: bool = False  # the choice's last delta was streamed; only Finished is missing
    next_seq: int = 2  # the next worker's first stream message gets this seq


class Assignment(Struct, kw_only=True):
    """Router → worker on ``Subjects.work(worker_id)`` (request/reply; reply is AssignmentAck)."""

    v: int = PROTOCOL_VERSION
    request: GenerateRequest
    route: RouteReason
    attempt: int = 1
    queued_s: float = 0.0  # time between publish and the router's decision
    # Disaggregated pools: the decode workers the prefill worker may hand off to, best first.
    decode_workers: list[str] = msgspec.field(default_factory=list)
    # Set when the request moves mid-stream from a lost worker (see Migrated).
    migration: Migration | None = None


class AssignmentAck(Struct):
    v: int = PROTOCOL_VERSION
    accepted: bool = True
    reason: str = ""


class ResendRequest(Struct, kw_only=True):
    """A stream reader → ``Subjects.resend(request_id)`` when a ``seq`` is missing (a message
    lost across a NATS reconnect): the worker writing the stream publishes again what it
    still holds from ``from_seq`` on (the last ``worker.resend_window`` messages of each
    stream, kept ``worker.resend_keep_s`` after it ends). Readers drop what they already have."""

    v: int = PROTOCOL_VERSION
    request_id: str
    from_seq: Annotated[int, msgspec.Meta(ge=1)]


class CancelRequest(Struct):
    """Anyone → ``Subjects.cancel(request_id)``. Workers free the request's blocks. A team's
    cancel reaches the fleet as ``cancel.<team>.<request_id>`` and counts only for that
    team's request of that id; the fleet cancels a team's request on the same subject
    (``Subjects.cancel_key(request.key)``)."""

    v: int = PROTOCOL_VERSION
    request_id: str = ""
    reason: str = "client_disconnected"
    # Non-empty: only this worker drops the request (the router taking a request away from a
    # worker it presumed lost); others running the same request id keep it.
    worker_id: str = ""


# ---------------------------------------------------------------- stream messages


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


# ---------------------------------------------------------------- fleet state


class WorkerBeat(Struct, kw_only=True):
    """Every worker, every ``worker.beat_interval_s``, on ``Subjects.beat(pool, role, id)``."""

    v: int = PROTOCOL_VERSION
    worker_id: str
    pool: str
    role: str
    model: str
    # The model's identity for KV reuse: its name plus the weights' format where that changes
    # answers (libs.settings.model_identity, e.g. "smollm2-135m-instruct@gguf"); blocks are
    # hashed under it. "" (older workers): the same as ``model``.
    model_id: str = ""
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    capacity: int = 0  # max running sequences
    block_size: int = 16
    max_model_len: int = 0
    ts: float = msgspec.field(default_factory=time.time)
    draining: bool = False
    # The decode rows' predicted step time over the pool's ITL target (LoadInfo.step_load):
    # >= 1 saturated; the router counts it as load.
    step_load: float = 0.0
    # The worker's region (``nats.region``, its NATS cluster; "": one region): routers place
    # in their own region first (docs/regions.md).
    region: str = ""
    # LoRA adapters loaded now (engine.max_loras; docs/engine.md "LoRA adapters"): a request
    # naming one of them in ``model`` runs without loading it first.
    adapters: list[str] = msgspec.field(default_factory=list)
    # What its engine's steps run: "compiled", "eager", or "compiling" (eager steps while a
    # graph compiles in the background, engine.compile_background); "": not an engine.
    forward: str = ""


# Stages a starting worker announces (WorkerStarting.stage), in order; "standby": loaded and
# waiting for the supervisor's activation (planner.warm_standby), not coming to serve by itself.
StartStage = Literal[
    "loading_model", "loading_kernels", "loading_graphs", "capturing_graphs", "standby"
]


class WorkerStarting(Struct, kw_only=True):
    """A worker process that is starting and does not beat yet, every ``worker.beat_interval_s``
    on ``Subjects.starting(pool, role, id)`` from its NATS connection to its first beat: what it
    is doing, so a router waits for it while it makes progress (``router.worker_stall_s``;
    decision 0037), and ``strait up`` activates only standbys that have loaded."""

    v: int = PROTOCOL_VERSION
    worker_id: str
    pool: str
    role: str
    stage: StartStage
    # Seconds the worker has been in ``stage`` (a stage that lasts past router.worker_stall_s
    # is a worker that stopped making progress).
    stage_s: float = 0.0
    pid: int = 0  # its process id (a supervisor tells its incarnations apart)
    ts: float = msgspec.field(default_factory=time.time)


class RouterBeat(Struct, kw_only=True):
    """Every router, every ``router.beat_interval_s``, on ``Subjects.router_beat(id)``: the
    requests it holds and has not placed yet, so the planner counts them as queued (they
    are in no worker's ``waiting``)."""

    v: int = PROTOCOL_VERSION
    router_id: str
    # pool → requests held while every worker of the pool was full (router.hold_*).
    held: dict[str, int] = msgspec.field(default_factory=dict)
    # pool → requests waiting for a worker to come back (router.worker_return_wait_s).
    waiting: dict[str, int] = msgspec.field(default_factory=dict)
    # pool → seconds the oldest held request has waited.
    oldest_held_s: dict[str, float] = msgspec.field(default_factory=dict)
    # pool → requests this router began holding since its last beat: arrivals the planner
    # counts now (their route events, later, carry the factor "held:<s>" and are not counted).
    held_arrivals: dict[str, int] = msgspec.field(default_factory=dict)
    ts: float = msgspec.field(default_factory=time.time)


class KvEvent(Struct, kw_only=True):
    """Blocks a worker stored into or evicted from its prefix cache (chain hashes)."""

    v: int = PROTOCOL_VERSION
    worker_id: str
    model: str
    stored: list[int] = msgspec.field(default_factory=list)
    evicted: list[int] = msgspec.field(default_factory=list)
    cleared: bool = False
    ts: float = msgspec.field(default_factory=time.time)


# ---------------------------------------------------------------- KV handoff (prefill → decode)
#
# States of one handoff, driven by the prefill worker (services/worker/prefill.py) and
# answered by the decode worker (services/worker/handoff.py):
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


class TeamsChanged(Struct, kw_only=True):
    """``strait teams add/revoke`` → ``Subjects.teams_changed`` (core NATS, fleet account only):
    routers reload the teams file now. Teams in ``revoked`` are refused from now on and their
    running requests are cancelled (nats-server has already closed their connections)."""

    v: int = PROTOCOL_VERSION
    revoked: list[str] = msgspec.field(default_factory=list)


class DrainRequest(Struct, kw_only=True):
    """Operator → ``Subjects.drain(worker_id)`` (core NATS; ``strait drain``): the worker does
    what SIGTERM makes it do — takes no new work, lets running requests finish for
    ``worker.drain_timeout_s``, hands the rest to the router to migrate, and exits."""

    v: int = PROTOCOL_VERSION
    worker_id: str
    reason: str = "operator"


class AdapterCommand(Struct, kw_only=True):
    """Operator → ``Subjects.adapters(pool)`` (core NATS, fleet account only; ``strait adapters``
    and the gateway's admin endpoint): every worker of the pool loads, unloads or lists its
    LoRA adapters (docs/engine.md "LoRA adapters") and answers with an ``AdapterReply``.
    ``load`` reads ``path`` (a directory on the worker's machine) or
    ``<pool.adapters_dir>/<name>``; ``unload`` frees the adapter's slot once the requests
    running on it have finished (none is cut short)."""

    v: int = PROTOCOL_VERSION
    action: Literal["load", "unload", "list"]
    name: str = ""  # the adapter (load, unload)
    path: str = ""  # load: its directory ("": the pool's adapters_dir/<name>)


class AdapterReply(Struct, kw_only=True):
    """A worker's answer to an ``AdapterCommand``: what it holds after it."""

    v: int = PROTOCOL_VERSION
    worker_id: str
    ok: bool = True
    error: str = ""  # why not: the adapter refused, unknown, or no LoRA slots
    # The error's kind, an ErrorCode ("" when ok): model_not_found (not in the pool's directory;
    # unload: not loaded here), invalid_request (the adapter refused), no_capacity, ...
    code: str = ""
    loaded: list[str] = msgspec.field(default_factory=list)


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


# ---------------------------------------------------------------- planner

PlanRole = Literal["aggregated", "prefill", "decode"]


class PlanDecision(Struct, kw_only=True):
    """The planner (``strait planner``) → ``Subjects.plan(pool, role)`` every
    ``planner.interval_s``: the workers of one role a pool should have now. A level, not a
    step: an actuator sets the count to ``replicas`` (starting workers, or draining the
    surplus), and with no decision (the planner gone) keeps what runs. ``reason`` is a code
    (docs/planner.md lists them); ``factors`` the inputs that decided it."""

    v: int = PROTOCOL_VERSION
    pool: str
    role: PlanRole
    replicas: Annotated[int, msgspec.Meta(ge=0)]
    current: int = 0  # live, not draining workers of the role seen in beats
    reason: str
    # What set the size before bounds and cooldowns: "forecast", "queue", "ttft_slo",
    # "min_bound", "idle", "wake" (docs/planner.md).
    driver: str = ""
    factors: list[str] = msgspec.field(default_factory=list)
    arrival_rps: float = 0.0  # measured over the last bucket
    forecast_rps: float = 0.0  # the forecast's peak over planner.horizon_s
    queue: int = 0  # requests waiting in the role's workers or held in routers
    worker_rps: float = 0.0  # requests a second one worker serves within the SLO
    capacity: Literal["measured", "prior"] = "prior"
    ttft_s: float | None = None  # at planner.slo_quantile, recent finished requests
    itl_s: float | None = None
    planner_id: str = ""
    ts: float = msgspec.field(default_factory=time.time)
    # The role's live, not draining workers (worker ids) in the order a scale-down should take
    # them: fewest requests running and waiting first (its drain ends soonest), the newest
    # first among equals. Empty: the actuator's own order (newest first).
    drain_order: list[str] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- batches (JetStream)


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


# ---------------------------------------------------------------- events (JetStream)


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


# ---------------------------------------------------------------- prefix cache
#
# The cache service (services/cache, docs/cache.md) holds KV blocks keyed by
# (model_id, salt, chain hash). Three request shapes:
#
#   lookup: CacheLookup --request/reply--> CacheLookupReply | ErrorMessage
#   fetch:  CacheFetch (reply = an inbox the requester subscribed to first) --> on that inbox:
#           1 message  CacheFetchReply | ErrorMessage (JSON, no chunk header), then
#           num_chunks messages of raw bytes, each with header CHUNK_HEADER = its index
#           (0-based); their concatenation is libs/engine/kv_transfer.encode() of the hits.
#   store:  fire-and-forget on cache_store: 1 message CacheStore (JSON), then num_chunks raw
#           messages with headers TRANSFER_HEADER = CacheStore.transfer_id and CHUNK_HEADER =
#           index; their concatenation is kv_transfer.encode() of the blocks to store.
#
# Chunks are at most min(nats.max_payload, the server's max_payload) - CHUNK_HEADROOM_BYTES
# (or cache.chunk_bytes when set), so any KV size crosses NATS. One publisher's messages to
# one subscriber arrive in order in NATS, so the JSON head comes before its chunks.

# NATS header naming a chunk's 0-based index in its transfer.
CHUNK_HEADER = "Strait-Chunk"
# NATS header naming the transfer (CacheStore.transfer_id) a store chunk belongs to.
TRANSFER_HEADER = "Strait-Transfer"
# Bytes of max_payload left for a chunk's NATS headers (chunk ids and trace context).
CHUNK_HEADROOM_BYTES = 1024

# Why a lookup's first missing block missed (every later block misses with it: a chain).
CacheMissReason = Literal[
    "shorter_than_one_block",  # no full block asked about
    "evicted",  # held once, evicted from every tier since
    "other_model",  # this hash is held, under another model id
    "salt",  # this hash is held for this model, under another salt
    "not_stored",  # never held (or forgotten past cache.evicted_history)
]


class CacheLookup(Struct, kw_only=True):
    """How many leading blocks of a prefix does the cache hold? (``Subjects.cache_lookup``)"""

    v: int = PROTOCOL_VERSION
    model_id: Annotated[str, msgspec.Meta(min_length=1)]
    block_hashes: list[int]  # chain hashes (libs/engine/hashing.py), in prefix order
    salt: str = ""  # isolates tenants: a block stored under one salt never hits under another


class CacheLookupReply(Struct, kw_only=True, tag="cache_lookup"):
    """Answer to CacheLookup: leading hits, and why the first miss missed."""

    v: int = PROTOCOL_VERSION
    num_hit_blocks: int
    miss_reason: CacheMissReason | None = None  # None: every block asked about is held


class CacheFetch(Struct, kw_only=True):
    """Send me the KV bytes of the leading held blocks of this prefix (``Subjects.cache_fetch``)."""

    v: int = PROTOCOL_VERSION
    model_id: Annotated[str, msgspec.Meta(min_length=1)]
    block_hashes: list[int]  # chain hashes, in prefix order
    salt: str = ""


class CacheFetchReply(Struct, kw_only=True, tag="cache_fetch"):
    """Head of a fetch answer: what the ``num_chunks`` raw chunks that follow add up to."""

    v: int = PROTOCOL_VERSION
    num_blocks: int  # leading blocks in the payload (0: nothing held, no chunks follow)
    total_bytes: int = 0  # length of the kv_transfer-encoded payload
    num_chunks: int = 0
    miss_reason: CacheMissReason | None = None  # why block ``num_blocks`` is not in it


class CacheStore(Struct, kw_only=True):
    """Head of a store transfer (``Subjects.cache_store``); ``num_chunks`` raw chunks follow."""

    v: int = PROTOCOL_VERSION
    transfer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    total_bytes: Annotated[int, msgspec.Meta(ge=1)]  # length of the kv_transfer encoding
    num_chunks: Annotated[int, msgspec.Meta(ge=1)]
    salt: str = ""


class CacheEvent(Struct, kw_only=True):
    """Blocks the cache service started or stopped holding (JetStream, ``cache_events``).

    Replaying the stream from the start in order rebuilds the set of held blocks; ``cleared``
    means "forget everything this cache_id held before" (sent at service start).
    """

    v: int = PROTOCOL_VERSION
    cache_id: str
    model_id: str = ""
    salt: str = ""
    stored: list[int] = msgspec.field(default_factory=list)  # chain hashes
    evicted: list[int] = msgspec.field(default_factory=list)  # left every tier
    cleared: bool = False
    ts: float = msgspec.field(default_factory=time.time)


# What a lookup's or a fetch head's reply subject receives.
CacheLookupAnswer = CacheLookupReply | ErrorMessage
CacheFetchAnswer = CacheFetchReply | ErrorMessage


# ---------------------------------------------------------------- subjects


class Subjects:
    """Every subject name, built from one prefix. Wildcards are for subscribers.

    With a ``region`` (``nats.region``, docs/regions.md) the subjects JetStream stores and the
    prefix-cache service's are the region's own, ``<prefix>.region.<region>.…``: each region's
    requests, events and cache live in its own cluster's streams, and its prefix cache answers
    its own workers. Every other subject (beats, work, streams, cancels) is one name for the
    whole supercluster and crosses the gateways."""

    def __init__(self, prefix: str = "strait.v1", region: str = "") -> None:
        self.prefix = prefix
        self.region = region
        self.regional = f"{prefix}.region.{region}" if region else prefix

    @classmethod
    def of(cls, nats: Any) -> Subjects:
        """The subjects of a process configured by ``nats`` (``NatsSettings``: its prefix and
        region)."""
        return cls(nats.subject_prefix, nats.region)

    @property
    def requests(self) -> str:
        return f"{self.regional}.requests"

    @property
    def team_requests_all(self) -> str:
        """Every team's requests subject (the requests stream takes these and ``requests``)."""
        return f"{self.prefix}.requests.*"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    # A process of the fleet's account that reads many streams (a gateway, a StraitClient)
    # names ``reply.<reader>.<request_id>`` as the ``reply_subject`` of the requests it submits
    # and reads them all through one subscription to ``reply.<reader>.*`` (no SUB/UNSUB and
    # server round trip per request, no subscription task per stream).
    def reply_stream(self, reader: str, request_id: str) -> str:
        return f"{self.prefix}.reply.{reader}.{request_id}"

    def reply_streams(self, reader: str) -> str:
        return f"{self.prefix}.reply.{reader}.*"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.cancel.{request_id}"

    def cancel_key(self, key: str) -> str:
        """Where the fleet cancels the request of ``key`` (``GenerateRequest.key``): a team's
        request on the subject its team's own cancel arrives on, ``cancel.<team>.<id>``."""
        return f"{self.prefix}.cancel.{key}"

    @property
    def cancel_all(self) -> str:
        """The fleet's cancels and the teams' (``cancel.<team>.<request_id>``)."""
        return f"{self.prefix}.cancel.>"

    def resend(self, request_id: str) -> str:
        return f"{self.prefix}.resend.{request_id}"

    @property
    def resend_all(self) -> str:
        return f"{self.prefix}.resend.>"

    # A team's account (docs/security.md) imports the fleet's ``requests.<team>`` as its own
    # ``requests``, ``cancel.<team>.*`` / ``resend.<team>.*`` as ``cancel.*`` / ``resend.*``,
    # and ``stream.<team>.*`` as ``stream.*``: a team's client uses the plain names, and the
    # fleet reads the sender's team from the subject, which the server wrote, not the sender.

    def team_requests(self, team: str) -> str:
        return f"{self.prefix}.requests.{team}"

    def team_stream(self, team: str, request_id: str) -> str:
        return f"{self.prefix}.stream.{team}.{request_id}"

    def team_of(self, subject: str, kind: Literal["requests", "cancel", "resend"]) -> str | None:
        """The team token of a team's ``requests``/``cancel``/``resend`` subject; None for the
        fleet's own (``requests``, ``cancel.<id>``, ``resend.<id>``). Raises ValueError for a
        subject of neither shape."""
        head = f"{self.prefix}.{kind}"
        if subject == head and kind == "requests":
            return None
        if not subject.startswith(head + "."):
            raise ValueError(f"not a {kind} subject: {subject!r}")
        tokens = subject[len(head) + 1 :].split(".")
        own = 0 if kind == "requests" else 1  # tokens a fleet subject has after the head
        if len(tokens) == own:
            return None
        if len(tokens) == own + 1 and valid_team(tokens[0]):
            return tokens[0]
        raise ValueError(f"not a {kind} subject: {subject!r}")

    def addressed(
        self, subject: str, kind: Literal["cancel", "resend"], named: str = ""
    ) -> tuple[str | None, str]:
        """(team, request id) a cancel or resend is for. A team's names its request in the
        subject (its import wrote ``<kind>.<team>.<id>``); the fleet's may name it in the
        message instead (``named``). Raises ValueError for a subject of neither shape."""
        team = self.team_of(subject, kind)
        rid = subject.rsplit(".", 1)[-1]
        return team, (named or rid) if team is None else rid

    @property
    def teams_changed(self) -> str:
        return f"{self.prefix}.admin.teams"

    def work(self, worker_id: str) -> str:
        return f"{self.prefix}.work.{worker_id}"

    def beat(self, pool: str, role: str, worker_id: str) -> str:
        return f"{self.prefix}.workers.{pool}.{role}.{worker_id}"

    @property
    def beats_all(self) -> str:
        return f"{self.prefix}.workers.>"

    def starting(self, pool: str, role: str, worker_id: str) -> str:
        return f"{self.prefix}.starting.{pool}.{role}.{worker_id}"

    @property
    def starting_all(self) -> str:
        return f"{self.prefix}.starting.>"

    def router_beat(self, router_id: str) -> str:
        return f"{self.prefix}.routers.{router_id}"

    @property
    def router_beats_all(self) -> str:
        return f"{self.prefix}.routers.*"

    def kv_events(self, worker_id: str) -> str:
        return f"{self.prefix}.kv_events.{worker_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv_events.*"

    def event(self, kind: Literal["usage", "route"]) -> str:
        return f"{self.regional}.events.{kind}"

    @property
    def worker_usage(self) -> str:
        """Workers' own UsageEvent of each finished request (source "worker"), for the ledger."""
        return f"{self.regional}.events.usage.worker"

    @property
    def events_all(self) -> str:
        return f"{self.regional}.events.>"

    def batch(self, batch_id: str) -> str:
        """The lines of one batch (``BatchLine``; purged by subject when it is cancelled)."""
        return f"{self.prefix}.batch.{batch_id}"

    @property
    def batch_all(self) -> str:
        return f"{self.prefix}.batch.*"

    def handoff_offer(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.offer"

    def handoff_commit(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.commit"

    def handoff_abort(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.abort"

    def handoff_kv(self, worker_id: str, transfer_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.kv.{transfer_id}"

    def handoff_kv_all(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.kv.*"

    def drain(self, worker_id: str) -> str:
        return f"{self.prefix}.admin.drain.{worker_id}"

    def adapters(self, pool: str) -> str:
        """``AdapterCommand`` to every worker of ``pool``."""
        return f"{self.prefix}.admin.adapters.{pool}"

    @property
    def stream_owner(self) -> str:
        return f"{self.prefix}.handoff.owner"

    def plan(self, pool: str, role: str) -> str:
        return f"{self.prefix}.planner.decision.{pool}.{role}"

    @property
    def plans_all(self) -> str:
        return f"{self.prefix}.planner.decision.>"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def cache_lookup(self) -> str:
        return f"{self.regional}.cache.lookup"

    @property
    def cache_fetch(self) -> str:
        return f"{self.regional}.cache.fetch"

    @property
    def cache_store(self) -> str:
        return f"{self.regional}.cache.store"

    @property
    def cache_events(self) -> str:
        return f"{self.regional}.cache.events"


# ---------------------------------------------------------------- codec

_encoder = msgspec.json.Encoder()
_stream_decoder = msgspec.json.Decoder(StreamMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


MAX_REQUEST_ID_CHARS = 128
# A team name is a subject token and part of a NATS account name.
TEAM_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def request_key(origin: str | None, request_id: str) -> str:
    """The fleet's key of a request: its id, or ``<team>.<id>`` for a team account's request.
    Unambiguous: request ids hold no ``.`` (``usable_request_id``) and team names none."""
    return request_id if origin is None else f"{origin}.{request_id}"


def valid_team(name: str) -> bool:
    return TEAM_NAME.fullmatch(name) is not None


def usable_request_id(rid: str) -> bool:
    """True when ``rid`` can name a stream subject: 1..128 characters, none of ``. * >`` and no
    whitespace. Anything else is never answered on ``stream.<rid>`` (it would be another
    subject, a wildcard, or a protocol line nats-server refuses), only dead-lettered."""
    return 0 < len(rid) <= MAX_REQUEST_ID_CHARS and not any(c in ".*>" or c.isspace() for c in rid)


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
