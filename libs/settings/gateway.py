"""The gateway's settings: its HTTP front door, and the Batch API runner it hosts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libs.settings.section import Section


class GatewaySettings(Section):
    host: str = "127.0.0.1"
    """Address the HTTP server listens on (0.0.0.0 in containers)."""
    port: int = 8000
    """Port the HTTP server listens on."""
    max_inflight: int = 256
    """Requests this gateway process will hold at once; past it: 503 + Retry-After."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Bytes of one request body (POST); past it: 413 request_too_large before the body is parsed."""
    publish_ack_timeout_s: float = 5.0
    """Seconds the gateway waits for JetStream's ack of a request or a usage event, and how many
    times it publishes (with the request id as Nats-Msg-Id, so the stream keeps one copy):
    under load an ack can come seconds late while the message is safely stored."""
    publish_attempts: int = Field(default=3, ge=1)
    """Publishes of one request or usage event before the gateway gives up (see
    `publish_ack_timeout_s`)."""
    first_message_timeout_s: float = 120.0
    """Seconds the gateway waits for the first stream message before giving up with 503."""
    idle_timeout_s: float = 60.0
    """Seconds of silence allowed between stream messages once a request is running."""
    shed_queue_depth: int = 256
    """Waiting requests of the target pool (the `waiting` of its live workers' beats; for
    `auto`, the least loaded pool) at which the gateway sheds new work with 429 queue_full,
    before publishing it. Keep it below `router.max_pool_queue`, the router's hard bound
    (503 no_capacity), so HTTP clients are told to slow down first."""
    shed_retry_after_s: float = 1.0
    """`Retry-After` of the gateway's own refusals: queue_full, its in-flight limit
    (`max_inflight`), a batch whose lines it could not queue."""
    auth_enabled: bool = True
    """Require an API key (`Authorization: Bearer`) on /v1 routes; false: every caller is the
    anonymous key."""
    http_parser: Literal["httptools", "h11"] = "httptools"
    """uvicorn's HTTP/1.1 parser: "httptools" (C, llhttp) or "h11" (pure Python)."""
    open_metrics: bool = False
    """Serve /metrics without an API key."""
    open_models: bool = False
    """Serve /v1/models without an API key."""
    admin_keys: list[str] = Field(default_factory=list)
    """API key ids (the `<id>` of `sk-strait-<id>-...`, as `strait keys list` shows it) allowed
    on the admin routes (`/admin/...`: a pool's LoRA adapters); any other key gets 403. With
    `auth_enabled` false every caller is the anonymous key, and the admin routes are open."""
    default_rpm: int = 600
    """Requests per minute of a key that sets none (a key may carry its own limits)."""
    default_tpm: int = 200_000
    """Tokens per minute (prompt + output) of a key that sets none."""
    response_cache_enabled: bool = True
    """Answer a repeated deterministic request (temperature 0, or a seed) from the exact-match
    response cache."""
    response_cache_entries: int = 1024
    """Answers the response cache holds (least recently used dropped first)."""
    response_cache_bytes: int = 16 * 1024 * 1024
    """Bytes of answers the response cache holds."""
    response_cache_ttl_s: float = 300.0
    """Seconds a cached answer is served."""
    log_prompts: bool = False
    """Allow prompt text in log lines (off: never logged)."""
    key_cache_ttl_s: float = 2.0
    """Seconds a verified (or rejected) API key is remembered; a revocation takes this long."""
    ledger_enabled: bool = True
    """Run the ledger writer (JetStream usage events -> database) inside the gateway process."""
    store_responses: bool = True
    """Keep /v1/responses answers (and their conversations) in the database for GET and
    previous_response_id when a request's `store` is true or unset (OpenAI's default);
    false: `store: true` is a 400."""
    response_history_max_messages: int = Field(default=256, ge=1)
    """Messages a stored conversation may hold (instructions aside); a follow-up past it through
    previous_response_id is a 400 naming this setting."""
    background_stop_s: float = Field(default=5.0, gt=0)
    """Seconds a stopping gateway waits for its background responses to store themselves
    "failed" (services/gateway/background.py) before it closes the database."""
    background_lease_s: float = Field(default=30.0, gt=0)
    """Seconds a background response's lease lasts: the gateway running it renews it every
    third of this; a response still queued or in_progress whose lease ran out (its gateway was
    killed) is stored "failed" by the next sweep of any gateway replica (at start, then every
    third of this)."""


class BatchSettings(Section):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``; docs/gateway.md, decision 0024): a
    batch's lines wait in JetStream (``nats.batch_stream``) and run as ``priority: "batch"``
    requests on capacity interactive traffic leaves."""

    runner_enabled: bool = True
    """Run a batch runner (the JetStream consumer of the lines) in each gateway process;
    replicas share its durable consumer. Off: batches are accepted and wait for a runner (a
    `strait batch` process runs one whatever this says)."""
    runner_process: bool = True
    """`strait up` runs the batch runner as a process of its own (`strait batch`, niced by
    runner_nice) and turns the gateway's off (decision 0028); false: in the gateway, as
    runner_enabled says."""
    runner_nice: int = Field(default=10, ge=0, le=19)
    """Niceness `strait batch` adds to itself: the kernel gives the CPU to interactive
    processes first (0: as they are)."""
    durable: str = "batch"
    """Name of the runners' durable JetStream consumer of the lines."""
    max_inflight: int = Field(default=16, ge=1)
    """Lines one runner has in the fleet at once."""
    reserve_slots: int = Field(default=8, ge=0)
    """Slots of a pool's workers (beats: capacity - running) kept free for interactive
    arrivals: a line is sent only while more than this many are free and no request waits."""
    room_poll_s: float = Field(default=0.05, gt=0)
    """Seconds between looks at the pool's beats while a line waits for room."""
    ack_wait_s: float = Field(default=30.0, gt=0)
    """Seconds a runner may hold a line without a word (it says "in progress" every third of
    it while the line waits or runs); past it JetStream gives the line to another runner."""
    fetch_wait_s: float = Field(default=1.0, gt=0)
    """Seconds the pull waits for lines when none are queued."""
    retry_s: float = Field(default=2.0, ge=0)
    """A line that failed in a way a retry can fix (no worker, no capacity, timeout, a lost
    worker) is given back to the stream after retry_s, at most max_attempts times; then it
    is an error line."""
    max_attempts: int = Field(default=5, ge=1)
    """Tries of one line (see `retry_s`) before it is an error line."""
    max_lines: int = Field(default=50_000, ge=1)
    """Lines of one input file (OpenAI: 50 000); the file's bytes are bounded by
    gateway.max_body_bytes."""
    window_s: float = Field(default=24 * 3600.0, gt=0)
    """Seconds a line is kept in the stream: OpenAI's one completion_window, "24h" (any other
    window is refused); a line not taken by then is dropped and its batch expires."""
    dedupe_window_s: float = Field(default=600.0, gt=0)
    """Seconds a line's Nats-Msg-Id is remembered by the stream (a re-publish within it is
    stored once; past it the result row still answers each line once)."""
    republish_after_s: float = Field(default=60.0, gt=0)
    """A batch still "validating" (its lines not all published: the gateway died) this long
    after creation has its lines published again by a runner's sweep."""
    sweep_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between a runner's sweeps (cancelled batches finalized, unpublished ones
    published again)."""
    max_errors_listed: int = Field(default=100, ge=1)
    """Errors a failed batch's `errors` lists (the rest are counted in the message)."""
