"""Prometheus metrics of a worker process (scraped at its /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

from libs.flow.labels import TenantLabels

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

RUNNING = Gauge("strait_worker_running_requests", "Requests this worker is serving")
WAITING = Gauge("strait_worker_waiting_requests", "Requests queued inside the engine")
KV_BLOCKS_USED = Gauge("strait_worker_kv_blocks_used", "KV blocks in use")
KV_BLOCKS_FREE = Gauge("strait_worker_kv_blocks_free", "KV blocks free (incl. evictable cached)")
TTFT = Histogram(
    "strait_worker_ttft_seconds",
    "Assignment to first token, by the request's priority class and tenant",
    ["priority", "tenant"],
    buckets=LATENCY_BUCKETS,
)
REQUESTS = Counter("strait_worker_requests_total", "Requests finished by status", ["status"])
OUTPUT_TOKENS = Counter("strait_worker_output_tokens_total", "Tokens generated")
PROMPT_TOKENS = Counter(
    "strait_worker_prompt_tokens_total",
    "Prompt tokens by how they were served: computed, or cached (prefix cache, incl. imported)",
    ["kind"],
)
CANCELLED = Counter("strait_worker_cancels_total", "Cancel messages that aborted a request")
ITL = Histogram(
    "strait_worker_itl_seconds",
    "Gap between consecutive token deltas of one request, by its priority class and tenant",
    ["priority", "tenant"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
E2E = Histogram("strait_worker_e2e_seconds", "Assignment to last token", buckets=LATENCY_BUCKETS)
QUEUE = Histogram(
    "strait_worker_queue_seconds",
    "Request publish to assignment (time spent queued ahead of the router)",
    buckets=LATENCY_BUCKETS,
)

# Disaggregated pools: the KV handoff (side: "prefill" sends, "decode" receives).
HANDOFFS = Counter(
    "strait_handoff_total",
    "KV handoffs by side and outcome (ok, failed, refused_<reason>, aborted, expired)",
    ["side", "outcome"],
)
HANDOFF_BYTES = Counter("strait_handoff_bytes_total", "KV bytes handed off", ["side"])
HANDOFF_SECONDS = Histogram(
    "strait_handoff_seconds",
    "Prefill side: first token sampled → decode worker committed the handoff",
    buckets=LATENCY_BUCKETS,
)
HANDOFF_CHUNKS_DROPPED = Counter(
    "strait_handoff_chunks_dropped_total", "KV chunks for unknown or malformed transfers"
)
RESENT = Counter(
    "strait_worker_resent_messages_total", "Stream messages published again for a ResendRequest"
)

# Tenants as label values (flow control, docs/flow-control.md), bounded by
# flow.max_tenant_labels (``configure_tenant_labels`` at start; later tenants read "other").
tenant_label = TenantLabels(32)


def configure_tenant_labels(limit: int) -> None:
    global tenant_label
    tenant_label = TenantLabels(limit)
