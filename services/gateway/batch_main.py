"""``strait batch``: the Batch API's runner as a process of its own (decision 0028).

The same ``BatchRunner`` a gateway runs with ``batch.runner_enabled`` (decision 0024), on a
fleet connection and database of its own, at a lower CPU priority (``batch.runner_nice``): its
per-line work (JetStream fetch and ack, the line's request and stream, the result row) then
stops competing with the gateway's interactive requests on the gateway's event loop, and the
kernel gives a busy machine's CPU to the interactive processes first. ``strait up`` starts one
with ``batch.runner_process`` and turns the gateway's own runner off. Runs until SIGTERM; lines
it holds then stay unacked and go to a runner again after ``batch.ack_wait_s``.
"""

from __future__ import annotations

import logging
import os

from libs.db import Database
from libs.db.batches import BatchStore
from libs.log import fields
from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.gateway.batch_runner import BatchRunner
from services.gateway.fleet import Fleet

log = logging.getLogger("strait.batch")


async def serve(ctx: ServiceContext) -> None:
    settings = ctx.settings
    if settings.batch.runner_nice:
        os.nice(settings.batch.runner_nice)
    fleet = Fleet(settings)
    db = Database(settings)
    runner: BatchRunner | None = None
    try:
        await db.migrate()
        await fleet.start()
        runner = BatchRunner(settings, fleet, BatchStore(db))
        await runner.start()
        ctx.serving(lambda: fleet.connected)
        log.info(
            "batch runner ready",
            extra=fields(nice=os.nice(0), max_inflight=settings.batch.max_inflight),
        )
        await ctx.stopping.wait()
    finally:
        if runner is not None:
            await runner.stop()
        await fleet.stop()
        await db.close()


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    return run_service("batch", serve, settings)
