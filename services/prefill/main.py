"""``strait prefill``: the prefill worker of a disaggregated pool (``worker.role = "prefill"``).

Connects to NATS, loads the real engine (KV handoff needs it), then serves ``work.<worker_id>``
and ``cancel.>`` and beats as role ``prefill`` until SIGTERM; each request is prefilled here and
handed to a decode worker (services/prefill/worker.py). With ``cache.enabled``, prompts' blocks
are fetched from and stored to the prefix-cache service.
"""

from __future__ import annotations

from libs.models.engine_backend import engine_backend
from libs.nats_util import connect
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.decode.main import arm_standby, run_worker
from services.prefill.worker import PrefillWorker, PrefixCache


def cache_client(nc: object, settings: Settings) -> PrefixCache | None:
    if not settings.cache.enabled:
        return None
    from libs.kv_cache_client import CacheClient

    return CacheClient(nc, settings)  # type: ignore[arg-type]


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings.model_copy(deep=True)
    settings.worker.role = "prefill"
    pool = settings.pool(settings.worker.pool)
    if pool is None:
        raise SystemExit(f"worker.pool {settings.worker.pool!r} is not in settings.pools")
    if pool.backend != "engine":
        raise SystemExit("a prefill worker needs backend = 'engine' (KV handoff)")
    backend = engine_backend(settings, pool)
    await backend.start()
    nc = await connect(settings.nats, f"prefill-{pool.name}")
    worker = PrefillWorker(nc, settings, backend, cache_client(nc, settings))
    await run_worker(ctx, nc, worker, [], [])


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    arm_standby(settings)
    return run_service("prefill", serve, settings, http_port=settings.worker.metrics_port)
