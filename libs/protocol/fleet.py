"""Fleet state and control: worker and router beats, start-up announcements, KV events, team
changes, drain and adapter commands, the planner's decisions.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from libs.protocol.base import PROTOCOL_VERSION, Struct


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
