"""What a worker says before it beats: ``WorkerStarting`` announcements (decision 0037).

A worker connects to NATS before it loads its backend, and runs an :class:`Announcer` while it
loads (``services.worker.process.start_announced``): every ``worker.beat_interval_s`` it publishes the stage the
engine reports (``AsyncEngineBackend.on_stage``, called from the loading thread) and how long
it has been in it. A router waits for the worker's pool while those keep coming and the stage
moves on (``router.worker_stall_s``). A standby publishes ``standby`` while it waits, loaded,
for its activation: ``strait up`` activates only standbys it has heard say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from nats.aio.client import Client as NATS

from libs.log import fields
from libs.protocol import StartStage, Subjects, WorkerStarting, encode
from libs.settings import Settings

log = logging.getLogger("strait.worker")


class Announcer:
    """Publishes one worker's ``WorkerStarting`` every beat interval while :meth:`run` runs."""

    def __init__(self, nc: NATS, settings: Settings, worker_id: str, role: str) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.pool = settings.worker.pool
        self.role = role
        self.interval_s = settings.worker.beat_interval_s
        self.subject = Subjects.of(settings.nats).starting(self.pool, role, worker_id)
        self.stage: StartStage = "loading_model"
        self.since = time.monotonic()

    def advance(self, stage: str) -> None:
        """The engine moved on to ``stage`` (any thread; one assignment each)."""
        if stage != self.stage:
            self.stage, self.since = stage, time.monotonic()  # type: ignore[assignment]
            log.info("worker starting", extra=fields(worker_id=self.worker_id, stage=stage))

    def announcement(self) -> WorkerStarting:
        return WorkerStarting(
            worker_id=self.worker_id,
            pool=self.pool,
            role=self.role,
            stage=self.stage,
            stage_s=round(time.monotonic() - self.since, 3),
            pid=os.getpid(),
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Announce now and every beat interval until ``stop`` is set."""
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a lost connection: the next one may go out
                await self.nc.publish(self.subject, encode(self.announcement()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
