"""Prometheus metrics of the cache service (scraped at its /metrics), all ``strait_cache_*``.

Block counters and tier sizes are read from the store at scrape time (:class:`StoreCollector`),
so the store stays the one source of truth; request-level counters are plain Counters here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.cache.store import BlockStore

REQUESTS = Counter(
    "strait_cache_requests_total", "Requests handled, by op and result", ["op", "result"]
)
REQUEST_SECONDS = Histogram(
    "strait_cache_request_seconds",
    "Time to answer a request (fetch: until the last chunk is handed to NATS)",
    ["op"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
TRANSFER_BYTES = Counter(
    "strait_cache_transfer_bytes_total", "KV payload bytes received (store) or sent (fetch)", ["op"]
)
EVENTS = Counter("strait_cache_events_total", "CacheEvents published to JetStream")
EVENT_ERRORS = Counter("strait_cache_event_errors_total", "CacheEvents JetStream did not take")


class StoreCollector(Collector):
    """Exports one BlockStore's counters; register it once per service instance."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats
        queries = CounterMetricFamily(
            "strait_cache_queries", "Blocks asked about (lookup and fetch)", labels=["op"]
        )
        hits = CounterMetricFamily(
            "strait_cache_hits", "Blocks asked about and held", labels=["op"]
        )
        for op in sorted(s.queries):
            queries.add_metric([op], s.queries[op])
            hits.add_metric([op], s.hits[op])
        misses = CounterMetricFamily(
            "strait_cache_misses",
            "Requests whose prefix broke before its end, by the first missing block's reason",
            labels=["op", "reason"],
        )
        for (op, reason), n in sorted(s.misses.items()):
            misses.add_metric([op, reason], n)
        evictions = CounterMetricFamily(
            "strait_cache_evictions",
            "Blocks that left a tier (memory: spilled or dropped; disk: dropped)",
            labels=["tier"],
        )
        for tier in ("memory", "disk"):
            evictions.add_metric([tier], s.evictions[tier])
        stored = CounterMetricFamily("strait_cache_stored_blocks", "Blocks newly held")
        stored.add_metric([], s.stored_blocks)
        refused = CounterMetricFamily(
            "strait_cache_refused_blocks", "Blocks larger than cache.memory_bytes"
        )
        refused.add_metric([], s.refused_blocks)
        size = GaugeMetricFamily("strait_cache_bytes", "KV bytes held", labels=["tier"])
        size.add_metric(["memory"], self.store.memory_bytes)
        size.add_metric(["disk"], self.store.disk_bytes)
        blocks = GaugeMetricFamily("strait_cache_blocks", "Blocks held", labels=["tier"])
        blocks.add_metric(["memory"], self.store.memory_blocks)
        blocks.add_metric(["disk"], self.store.disk_blocks)
        yield from (queries, hits, misses, evictions, stored, refused, size, blocks)
