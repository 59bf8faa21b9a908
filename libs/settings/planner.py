"""The planner's settings (`strait planner`): forecast, sizing rules, actuators."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from libs.settings.section import Section


class PoolPlanSettings(Section):
    """One pool's sizing rules for the planner (docs/planner.md). Counts are worker processes
    of one role: aggregated (or decode) workers, and prefill workers of a disaggregated pool."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest aggregated (or decode) workers. 0 lets the pool scale to zero after
    `planner.idle_to_zero_s` without arrivals (its next request then waits a worker's start,
    or gets no_worker)."""
    max_replicas: int = Field(default=4, ge=1)
    """Most aggregated (or decode) workers."""
    min_prefill_replicas: int = Field(default=1, ge=0)
    """Fewest prefill workers of a disaggregated pool."""
    max_prefill_replicas: int = Field(default=4, ge=1)
    """Most prefill workers of a disaggregated pool."""
    ttft_slo_s: float = Field(default=2.0, gt=0)
    """Time to first token the pool is sized for, as the client sees it (router queue +
    worker), at `planner.slo_quantile`."""
    itl_slo_s: float = Field(default=0.1, gt=0)
    """Time between tokens the pool is sized for, at `planner.slo_quantile`."""
    prior_concurrency: int = Field(default=0, ge=0)
    """Prior until a worker's capacity is measured (`planner.min_samples` finished requests,
    as for the other priors): sequences one worker runs within the ITL SLO; 0: the capacity its
    beats report."""
    prior_service_s: float = Field(default=5.0, gt=0)
    """Prior: seconds a request holds a worker."""
    prior_prefill_tokens_per_s: float = Field(default=2000.0, gt=0)
    """Prior: prompt tokens a second one prefill worker computes."""

    @model_validator(mode="after")
    def _bounds(self) -> PoolPlanSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("planner: min_replicas exceeds max_replicas")
        if self.min_prefill_replicas > self.max_prefill_replicas:
            raise ValueError("planner: min_prefill_replicas exceeds max_prefill_replicas")
        return self


class PlannerSettings(Section):
    """The planner (`strait planner`, services/planner, docs/planner.md): forecasts each pool's
    arrivals and publishes the replicas it needs; an actuator applies them. Advisory: without
    decisions (the planner stopped) every actuator keeps the fleet's current size."""

    enabled: bool = False
    """`strait up` starts the planner and lets it resize the pools (local actuator); off, the
    fleet is the size `pools[].workers` says."""
    actuator: Literal["local", "kubernetes", "none"] = "local"
    """Who applies the decisions the planner publishes: "local" (the `strait up` supervisor
    subscribes), "kubernetes" (the planner sets Deployment replicas itself), "none" (advice)."""
    interval_s: float = Field(default=2.0, gt=0)
    """Seconds between decisions."""
    bucket_s: float = Field(default=5.0, gt=0)
    """Seconds of one step of the arrival series the forecast reads."""
    history_s: float = Field(default=900.0, gt=0)
    """Seconds of arrival series kept."""
    horizon_s: float = Field(default=60.0, gt=0)
    """Seconds ahead the pool is sized for: the time more capacity takes to serve (a new
    worker's start-up, ~15-20 s for a real one with saved graphs; a warm standby's activation,
    ~1-2 s), so capacity is ready when the forecast load arrives. The pool has the fewest
    workers whose queue over this long keeps the TTFT within the SLO at `slo_quantile`
    (services/planner/queueing.py): it runs near full when the wait that may build before more
    capacity comes fits in the SLO."""
    forecast_method: Literal["holt", "arima", "ewma", "last"] = "holt"
    """"holt" (damped-trend exponential smoothing), "arima", "ewma", "last"; docs/planner.md
    has each one's measured error on the shipped traces (bench/planner_forecast.py)."""
    policy: Literal["forecast", "reactive"] = "forecast"
    """"forecast": the rules of docs/planner.md (forecast, queue and TTFT terms, the error
    budget).
    "reactive": a baseline that sizes on queue depth alone, as KEDA's lag trigger does:
    ceil(requests waiting in the role's workers / reactive_queue_per_worker) (the manifests'
    lagThreshold), same bounds and cooldowns; bench/autoscaling.py compares the two."""
    reactive_queue_per_worker: int = Field(default=16, ge=1)
    """"reactive" policy: waiting requests one worker is sized for."""
    min_history_buckets: int = Field(default=6, ge=2)
    """Buckets of history below which the forecast is the recent mean (no model fitted)."""
    forecast_z: float = Field(default=0.0, ge=0)
    """The plan sizes for the forecast's peak plus this many standard deviations of the
    series' bucket-to-bucket noise. 0: the queue model (`horizon_s`) already carries the
    arrivals' scatter around the forecast; more is a margin for the forecast's own error."""
    target_utilization: float = Field(default=0.0, ge=0, le=1)
    """A floor: the plan never has fewer workers than the forecast over (worker capacity x
    this). 0 (the default): no floor; the queue model sizes the pool (`slo_quantile`, the error
    budget), which may plan a pool briefly over capacity while the queue that builds stays
    within the SLO (decision 0032)."""
    slo_quantile: float = Field(default=0.95, gt=0, lt=1)
    """The share of requests the plan keeps within the pool's TTFT SLO (and the quantile of TTFT
    and ITL compared with it). The pool is sized at this quantile of the predicted TTFT while
    the error budget (1 - this) is being spent; see `budget_quantile_floor`."""
    budget_quantile_floor: float = Field(default=0.3, gt=0, lt=1)
    """The error budget (the share of requests the SLO lets miss, 1 - `slo_quantile`): while
    the pool's requests of the last `budget_window_s` missed the TTFT SLO at less than
    `budget_spend` of it, the pool is sized at this quantile of the predicted TTFT instead of
    `slo_quantile`. A pool of a few whole workers sized at `slo_quantile` at every decision
    misses far fewer requests than the SLO allows; spending the budget is how it time-shares
    between n and n + 1 workers. A request held for `scale_up_urgent_fraction` of the SLO
    sizes at `slo_quantile` whatever the budget. Equal to `slo_quantile` (or above): no budget
    is spent (decision 0032)."""
    step_z: float = Field(default=3.0, gt=0)
    """The arrivals of the last `bucket_s` are a step the forecast did not see when they exceed
    it by this many of their Poisson standard deviations; a step sizes at `slo_quantile`
    (the error budget is for the load the forecast knows)."""
    budget_window_s: float = Field(default=600.0, gt=0)
    """Seconds of finished requests the error budget is measured over."""
    budget_spend: float = Field(default=0.5, ge=0, lt=1)
    """Share of the error budget spent freely: below it decisions size at
    `budget_quantile_floor`; from it to the whole budget the quantile rises linearly to
    `slo_quantile`."""
    scale_up_cooldown_s: float = Field(default=5.0, ge=0)
    """Seconds after a change before the next scale-up."""
    scale_up_urgent_fraction: float = Field(default=0.5, ge=0)
    """A request held in a router (every worker full) for this fraction of the pool's TTFT SLO
    makes a larger need go through the up-cooldown, sized at `slo_quantile`: that request
    misses the SLO unless capacity comes now. Not while workers the last decision added are
    still coming (fewer beat than it decided, less than `horizon_s` ago): they were decided
    for it. 0: the cooldown always holds."""
    scale_down_cooldown_s: float = Field(default=60.0, ge=0)
    """Seconds after a change before the next scale-down."""
    scale_down_stable_s: float = Field(default=60.0, ge=0)
    """The scale-down window. "forecast" policy: a scale-down needs the mean arrival rate of
    this window (with the queue now) to fit fewer workers, and the
    decision now to want fewer. "reactive" policy: every decision of this window must have
    wanted fewer (an HPA's stabilization window)."""
    warm_standby: int = Field(default=0, ge=0)
    """Local actuator: workers of each pool role `strait up` keeps loaded but idle (no beats, no
    work: memory, not compute), activated first when the planner wants more workers, so a
    scale-up takes a signal instead of a start-up. A scale-down while the role holds fewer
    parks the surplus worker back into standby (SIGUSR2: it drains, then waits loaded); a
    standby used and not parked back is replaced (after `standby_refill_s`)."""
    standby_refill_s: float = Field(default=10.0, ge=0)
    """Local actuator: seconds after a standby's activation (or the last refill) before its
    replacement starts loading, one at a time per pool role, so replacements do not take the
    machine's cores from the wave that used their predecessors."""
    max_scale_down_step: int = Field(default=1, ge=1)
    """Workers removed by one scale-down decision (each drains: nothing running is dropped)."""
    idle_to_zero_s: float = Field(default=300.0, gt=0)
    """A pool with min_replicas = 0 goes to zero after this long without an arrival."""
    min_samples: int = Field(default=20, ge=1)
    """Finished requests (per pool and role) before measured capacity replaces the priors."""
    max_samples: int = Field(default=2000, ge=10)
    """Recent finished requests kept per pool and role."""
    decision_max_age_s: float = Field(default=30.0, gt=0)
    """An actuator ignores a decision older than this (a planner's clock or a stale message)."""
    kubernetes_namespace: str = "strait"
    """Kubernetes actuator: the namespace of the pools' Deployments."""
    kubernetes_deployment: str = "strait-worker-{pool}"
    """Kubernetes actuator: Deployment of a pool's aggregated (or decode) workers (`{pool}`
    replaced)."""
    kubernetes_prefill_deployment: str = "strait-prefill-{pool}"
    """Kubernetes actuator: Deployment of a pool's prefill workers (`{pool}` replaced)."""
    metrics_port: int = 9103
    """Port of the /health, /ready, /metrics listener; 0: none."""
    default: PoolPlanSettings = Field(default_factory=PoolPlanSettings)
    """Sizing rules of a pool not named in `pools`."""
    pools: dict[str, PoolPlanSettings] = Field(default_factory=dict)
    """Per pool by name; a pool not named here gets `default`."""

    def for_pool(self, name: str) -> PoolPlanSettings:
        return self.pools.get(name, self.default)
