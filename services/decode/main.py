"""``strait worker`` of the role ``decode`` (``strait decode`` with ``worker.role = "decode"``):
a disaggregated pool's decode side. Its requests arrive as KV handoffs from prefill workers
(``services/decode/handoff.py``'s ``HandoffReceiver``) and run on a ``DecodeWorker``
(``services/decode/worker.py``); the process is every role's (``services/worker/process.py``).
"""

from __future__ import annotations

import asyncio

from libs.engine.async_engine import AsyncEngineBackend
from libs.runtime import ServiceContext
from libs.settings import Settings
from libs.wire.nats_util import connect
from services.decode.handoff import HandoffReceiver
from services.decode.worker import DecodeWorker
from services.worker.process import build_backend, run_role, run_worker, start_announced


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    backend = build_backend(settings)
    if not isinstance(backend, AsyncEngineBackend):
        raise SystemExit("worker.role = 'decode' needs backend = 'engine' (KV handoff)")
    # Connected before loading: the router hears what the worker is doing (Announcer).
    nc = await connect(settings.nats, f"worker-{settings.worker.pool}")
    await start_announced(nc, settings, backend)
    worker = DecodeWorker(nc, settings, backend)
    receiver = HandoffReceiver(worker, backend)
    subs = await receiver.subscribe()
    tasks = [asyncio.create_task(receiver.sweep_loop(ctx.stopping))]
    await run_worker(ctx, nc, worker, subs, tasks)


def main(settings: Settings) -> int:
    return run_role(settings, "worker", serve)
