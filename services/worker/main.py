"""``strait worker`` of the role ``aggregated`` (the default): prefill and decode in this one
process (``AggregatedWorker``), on the real engine or the FAKE backend (``backend = "fake"``).

The other roles have packages of their own (``services/prefill/``, ``services/decode/``);
``strait worker`` picks the role's entry by ``worker.role`` (``services/cli.py``). Every role's
process ends in ``services/worker/process.py``'s ``run_worker``.
"""

from __future__ import annotations

from libs.runtime import ServiceContext
from libs.settings import Settings
from libs.wire.nats_util import connect
from services.worker.aggregated import AggregatedWorker
from services.worker.process import build_backend, run_role, run_worker, start_announced


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    backend = build_backend(settings)
    # Connected before loading: the router hears what the worker is doing (Announcer).
    nc = await connect(settings.nats, f"worker-{settings.worker.pool}")
    await start_announced(nc, settings, backend)
    await run_worker(ctx, nc, AggregatedWorker(nc, settings, backend), [], [])


def main(settings: Settings) -> int:
    return run_role(settings, "worker", serve)
