"""``strait prefill`` (``strait worker`` of the role ``prefill``): a disaggregated pool's prefill
side. A ``PrefillWorker`` (``services/prefill/worker.py``) on the engine (a KV handoff needs
it), with the prefix-cache service's client when ``cache.enabled``; it hands each request to a
decode worker (``services/prefill/handoff.py``). The process is every role's
(``services/worker/process.py``).
"""

from __future__ import annotations

from nats.aio.client import Client as NATS

from libs.models.engine_backend import engine_backend
from libs.runtime import ServiceContext
from libs.settings import Settings
from libs.wire.nats_util import connect
from services.prefill.worker import PrefillWorker, PrefixCache
from services.worker.process import run_role, run_worker, start_announced


def cache_client(nc: NATS, settings: Settings) -> PrefixCache | None:
    if not settings.cache.enabled:
        return None
    from libs.wire.kv_cache_client import CacheClient

    return CacheClient(nc, settings)


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings.model_copy(deep=True)
    settings.worker.role = "prefill"
    pool = settings.pool(settings.worker.pool)
    if pool is None:
        raise SystemExit(f"worker.pool {settings.worker.pool!r} is not in settings.pools")
    if pool.backend != "engine":
        raise SystemExit("a prefill worker needs backend = 'engine' (KV handoff)")
    backend = engine_backend(settings, pool)
    nc = await connect(settings.nats, f"prefill-{pool.name}")
    await start_announced(nc, settings, backend)
    worker = PrefillWorker(nc, settings, backend, cache_client(nc, settings))
    await run_worker(ctx, nc, worker, [], [])


def main(settings: Settings) -> int:
    return run_role(settings, "prefill", serve)
