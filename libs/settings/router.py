"""The router's settings: pool choice, placement, re-placement, and the teams it enforces."""

from __future__ import annotations

from pydantic import Field

from libs.settings.section import Section


class ClassifierSettings(Section):
    """The heuristic difficulty classifier's factors (docs/router.md lists them)."""

    kind: str = "heuristic"
    """"heuristic", or "module:factory" naming a callable(Settings) -> Classifier (a learned one)."""
    long_prompt_chars: int = 2000
    """Prompt characters from which the `long_prompt` factor fires."""
    long_prompt: float = 0.5
    """Weight of the `long_prompt` factor."""
    long_output_tokens: int = 512
    """Requested `max_tokens` from which the `long_output` factor fires."""
    long_output: float = 0.5
    """Weight of the `long_output` factor."""
    code: float = 0.6
    """Weight of the `code` factor (code fences or code syntax in the prompt)."""
    math: float = 0.6
    """Weight of the `math` factor (equations or math words in the prompt)."""
    multi_step: float = 0.4
    """Weight of the `multi_step` factor ("step by step", "compare", "plan", ... in the prompt)."""
    deep_conversation_turns: int = 6
    """Messages from which the `deep_conversation` factor fires."""
    deep_conversation: float = 0.3
    """Weight of the `deep_conversation` factor."""


class RouterSettings(Section):
    assign_timeout_s: float = 2.0
    """Seconds a worker has to accept an assignment before the router tries another."""
    large_threshold: float = 1.0
    """Difficulty score at or above which `auto` goes to the large pool."""
    small_pool: str = "small"
    """Pool `auto` requests below `large_threshold` go to (with `large_pool` configured)."""
    large_pool: str = "large"
    """Pool `auto` requests at or above `large_threshold` go to."""
    default_pool: str = "default"
    """Pool `auto` requests go to when the small and large pools are not both configured."""
    classifier: ClassifierSettings = Field(default_factory=ClassifierSettings)
    """The difficulty classifier of `auto` requests."""
    overlap_weight: float = 1.0
    """Placement cost = overlap_weight * uncached_prompt_tokens / prefill_norm_tokens
    + load_weight * (running + waiting + pending) / capacity"""
    load_weight: float = 1.0
    """Weight of the load term of the placement cost (see `overlap_weight`)."""
    prefill_norm_tokens: int = 1024
    """Uncached prompt tokens that cost as much as one fully loaded worker."""
    tie_epsilon: float = 0.05
    """Costs within this of the best are ties, chosen between at random (no herding)."""
    max_pool_queue: int = 512
    """Requests waiting in a pool (its workers' beats plus assignments offered since) at which
    the router refuses new work for it with no_capacity, for every client; also the most
    requests it holds for a worker coming back (`worker_return_wait_s`). The gateway sheds
    HTTP work earlier (`gateway.shed_queue_depth`)."""
    spill_over: bool = True
    """No live worker in the chosen pool: use another pool allowed for the request."""
    saturation_spill: bool = False
    """Every worker of the chosen pool at or past `saturation_load`: spill to an allowed pool
    below it."""
    saturation_load: float = 1.0
    """Load (running + waiting over capacity) at which a worker counts as full for
    `saturation_spill`."""
    cross_region_cost: float = Field(default=1.0, ge=0)
    """Placement cost added to a worker of another region (as much as one fully loaded
    worker by default). The router places in its own region (`nats.region`) while a live
    worker of the pool there is below `saturation_load`; past that, or with none, every
    region's workers compete with this added to the remote ones, so the nearest and least
    loaded wins (docs/regions.md)."""
    region_costs: dict[str, float] = Field(default_factory=dict)
    """Crossing cost to particular regions (region → cost), instead of
    `cross_region_cost`: a nearer region costs less."""
    adapter_miss_cost: float = Field(default=0.5, ge=0)
    """Placement cost added to a worker that does not have the request's LoRA adapter loaded
    (its beats' `adapters`): it reads the adapter from disk first and may evict another.
    Half a fully loaded worker by default: a worker holding the adapter wins until it is that
    much more loaded than one without."""
    max_attempts: int = 3
    """Placements of one request (the first, re-placements and migrations) before it ends with
    worker_lost."""
    worker_return_wait_s: float = Field(default=30.0, ge=0)
    """A worker lost without draining (a crash or kill: `strait up`'s supervisor, the planner or
    Kubernetes brings it back) makes its pool "coming back" for this long: the pool's new
    requests stay queued for a worker instead of a 503 no_worker (at most
    max_pool_queue of them), and a stream it was running pauses (Migrated, reason
    waiting_for_worker) and goes on from the first worker that beats in the pool. Past it:
    no_worker / worker_lost. It bounds the time until the restarted worker announces itself
    (it connects to NATS before it loads); from then on the pool is awaited while the worker
    makes progress (`worker_stall_s`). 0: never wait."""
    worker_stall_s: float = Field(default=120.0, ge=0)
    """A starting worker announces its stage (loading the model, the kernels, the compiled
    graphs) every beat interval until it beats; its pool's requests wait for it while it
    announces and has been in its stage no longer than this (a stage held longer is a worker
    that stopped making progress: no_worker, as for a worker that never came). 0: no
    announcement makes a pool wait."""
    max_watched: int = 10_000
    """Requests the router watches at once (to move them when their worker is lost)."""
    watch_ttl_s: float = 120.0
    """Seconds a watched stream may stay silent before the router forgets it."""
    stall_timeout_s: float = 30.0
    """A started stream silent this long while its worker still beats is moved like a lost
    worker's (a hung engine); 0: never. Below the gateway's idle timeout, above any step."""
    tokenize_cache_entries: int = 4096
    """Tokenizations (per message / prompt) cached by the prefix hasher of each model."""
    sweep_interval_s: float = 0.1
    """Seconds between registry sweeps (expiry → re-placement)."""
    batch_hold_max_s: float = Field(default=30.0, ge=0)
    """A `priority: "batch"` request is held (unacked, kept alive) while its pool has a waiting
    request or fewer free slots than batch.reserve_slots, up to this long; then it is placed
    (the engine's scheduler still runs interactive work first and preempts batch work)."""
    hold_queue_per_worker: int = Field(default=4, ge=0)
    """Late binding: a new request is held (unacked, kept alive, in arrival order) while every
    worker of its pool already holds its capacity plus this many waiting requests, and is
    placed on the first worker with room, a worker that starts meanwhile included (the
    planner's scale-out takes the queue over instead of finding it stuck in the old workers).
    Held requests count in max_pool_queue (decision 0026)."""
    hold_max_s: float = Field(default=300.0, ge=0)
    """Longest hold; then the request is placed on the best worker's queue. 0: never hold. Above
    `flow.queue_timeout_s`, so that a held request ends by its deadline: a request placed at
    this bound skips the fair order (docs/flow-control.md)."""
    beat_interval_s: float = Field(default=0.5, gt=0)
    """Seconds between the router's beats (RouterBeat: its held requests, for the planner)."""
    metrics_port: int = 9101
    """Port of the /health, /ready, /metrics listener; 0: none."""


class TeamsSettings(Section):
    """Teams on NATS (docs/security.md). The router reads the teams file that ``strait teams``
    writes: each team's limits, and which teams are revoked."""

    file: str = ""
    """The teams file `strait teams` writes; empty: <state_dir>/secure/teams.json."""
    default_rpm: int = 600
    """Requests per minute of a team whose entry sets none, with the gateway's semantics (per
    router replica)."""
    default_tpm: int = 200_000
    """Tokens per minute (prompt + output) of a team whose entry sets none."""
    reload_interval_s: float = 2.0
    """Seconds between checks of the file's modification time (a change is also announced on
    Subjects.teams_changed by `strait teams`)."""
