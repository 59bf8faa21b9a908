"""Requests and their placement: ``GenerateRequest`` (client/gateway → JetStream), the router's
``Assignment`` to a worker and its ack, resend and cancel.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from libs.engine.params import ChatMessage, Priority, SamplingParams, ToolChoice, ToolFunction
from libs.protocol.base import PROTOCOL_VERSION, Struct, request_key


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
