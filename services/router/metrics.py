"""Prometheus metrics of the router process."""

from prometheus_client import Counter, Gauge, Histogram

from libs.flow.labels import TenantLabels

DECISIONS = Counter("strait_router_decisions_total", "Routing decisions", ["pool", "reason"])
DECISION_SECONDS = Histogram(
    "strait_router_decision_seconds",
    "Time to decide a placement (classify, hash the prompt, rank the workers)",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
QUEUE_SECONDS = Histogram(
    "strait_router_queue_seconds",
    "Request publish to routing decision",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
OVERLAP_BLOCKS = Histogram(
    "strait_router_overlap_blocks",
    "Prompt blocks the chosen worker already held",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
)
LIVE_WORKERS = Gauge(
    "strait_router_live_workers",
    "Workers with a fresh beat, by pool and region",
    ["pool", "region"],
)
CROSS_REGION = Counter(
    "strait_router_cross_region_total",
    "Requests placed on a worker of another region than the router's (docs/regions.md)",
    ["region", "reason"],
)
WATCHED = Gauge("strait_router_watched_requests", "Requests placed whose stream has not ended")
UNWATCHED = Counter(
    "strait_router_unwatched_total", "Requests not watched for re-placement (router.max_watched)"
)
REPLACED = Counter(
    "strait_router_replaced_total", "Requests placed again after a worker was lost before output"
)
MIGRATED = Counter(
    "strait_router_migrated_total",
    "Requests moved mid-stream to another worker after theirs was lost",
)
REDELIVERED = Counter(
    "strait_router_redelivered_total",
    "Requests JetStream delivered again (a router died holding them, or took past the ack wait)",
)
REJECTED = Counter("strait_router_rejected_total", "Requests answered with an error", ["code"])
WAITING = Gauge(
    "strait_router_waiting_for_worker",
    "Requests waiting for a worker to come back to their pool (router.worker_return_wait_s)",
    ["pool"],
)
WAIT_SECONDS = Histogram(
    "strait_router_wait_for_worker_seconds",
    "Time a request waited for a worker to come to its pool",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
BATCH_HELD = Counter(
    "strait_router_batch_held_total",
    "priority batch requests held because their pool had no room (router.batch_hold_max_s)",
)
BATCH_HOLD_SECONDS = Histogram(
    "strait_router_batch_hold_seconds",
    "Time a held batch request waited for room in its pool",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
)
HELD = Gauge(
    "strait_router_held_requests",
    "Requests held because every worker of their pool was full (router.hold_queue_per_worker)",
    ["pool"],
)
HOLD_SECONDS = Histogram(
    "strait_router_hold_seconds",
    "Time a held request waited for a worker with room",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
)

# Flow control (docs/flow-control.md): tenants as label values, bounded by
# flow.max_tenant_labels (``configure_tenant_labels`` at start; later tenants read "other").
_tenant_labels = TenantLabels(32)


def configure_tenant_labels(limit: int) -> None:
    global _tenant_labels
    _tenant_labels = TenantLabels(limit)


def tenant_label(tenant: str) -> str:
    return _tenant_labels(tenant)


TENANT_HELD = Gauge(
    "strait_router_tenant_held",
    "Requests held for room in a pool, by tenant (flow control's queue depth)",
    ["pool", "tenant"],
)
TENANT_TOKENS = Counter(
    "strait_router_tenant_output_tokens_total",
    "Output tokens streamed to requests this router placed, by pool and tenant",
    ["pool", "tenant"],
)
TENANT_COUNTER = Gauge(
    "strait_router_tenant_counter",
    "A tenant's fair-share counter in a pool at its last placement (virtual tokens: served "
    "over weight)",
    ["pool", "tenant"],
)
FLOW_REFUSED = Counter(
    "strait_router_flow_refused_total",
    "Requests ended by flow control: over_share (the tenant's waiting bound) or "
    "deadline_exceeded (its queue deadline)",
    ["pool", "tenant", "code"],
)
