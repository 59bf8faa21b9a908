"""``strait cache``: the prefix-cache service (docs/cache.md).

Connects to NATS, provisions its event stream, serves ``cache.lookup``, ``cache.fetch`` and
``cache.store`` until SIGTERM, then stops taking requests, publishes the events still queued and
closes. ``/health``, ``/ready`` and ``/metrics`` listen on ``cache.metrics_port``.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from libs.log import fields
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from libs.wire.nats_util import connect
from services.cache.metrics import StoreCollector
from services.cache.service import CacheService

log = logging.getLogger("strait.cache")

# Seconds queued events get to reach JetStream after SIGTERM.
DRAIN_TIMEOUT_S = 10.0


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    nc = await connect(settings.nats, "cache")
    service = CacheService(nc, nc.jetstream(), settings)
    collector = StoreCollector(service.store)
    REGISTRY.register(collector)
    try:
        await service.start()
        ctx.serving(lambda: nc.is_connected)
        log.info(
            "cache ready",
            extra=fields(
                cache_id=service.cache_id,
                memory_bytes=settings.cache.memory_bytes,
                disk_dir=settings.cache.disk_dir or None,
                disk_bytes=service.store.disk_budget,
            ),
        )
        await ctx.stopping.wait()
    finally:
        await service.close(DRAIN_TIMEOUT_S)
        REGISTRY.unregister(collector)
        await nc.drain()


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    return run_service("cache", serve, settings, http_port=settings.cache.metrics_port)
