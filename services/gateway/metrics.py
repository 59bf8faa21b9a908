"""Prometheus metrics of the gateway process (served at /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter(
    "strait_gateway_requests_total", "Requests by kind and outcome", ["kind", "status"]
)
TTFT = Histogram("strait_gateway_ttft_seconds", "Request to first token", buckets=LATENCY_BUCKETS)
E2E = Histogram("strait_gateway_e2e_seconds", "Request to last byte", buckets=LATENCY_BUCKETS)
OUTPUT_TOKENS = Counter("strait_gateway_output_tokens_total", "Tokens streamed to clients")
MIGRATIONS = Counter(
    "strait_gateway_migrations_total", "Streams the router moved to another worker mid-stream"
)
INFLIGHT = Gauge("strait_gateway_inflight_requests", "Requests this gateway holds")
REJECTED = Counter(
    "strait_gateway_rejected_total", "Requests refused before reaching the fleet", ["code"]
)
