"""A worker's side of the ledger: one ``UsageEvent`` (source ``worker``) per finished request,
published to JetStream in the background (``worker.report_usage``; deduplicated by its message
id, retried ``worker.usage_publish_attempts`` times), never failing the stream it counts; the
gateway's own event may still carry the request when it is lost. Flushed before the connection
closes (``services.worker.process.run_worker``)."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from libs.log import fields
from libs.protocol import Assignment, Subjects, Usage, UsageEvent, encode, request_key
from libs.settings import WorkerSettings
from libs.wire.nats_util import publish_acked

log = logging.getLogger("strait.worker")


def usage_event(
    a: Assignment,
    request_id: str,
    usage: Usage,
    ttft: float | None,
    total: float,
    *,
    pool: str,
    model: str,
    worker_id: str,
) -> UsageEvent:
    """The ledger's row of one finished request, as its worker saw it."""
    return UsageEvent(
        request_id=request_id,
        origin=a.request.origin,
        api_key_id=a.request.api_key_id,
        team=a.request.team,
        pool=pool,
        model=model,
        worker_id=worker_id,
        route_code=a.route.code,
        route_factors=a.route.factors,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        queued_s=a.queued_s,
        ttft_s=ttft,
        total_s=total,
        created_at=a.request.created_at,
        source="worker",
    )


class UsageReporter:
    def __init__(self, nc: NATS, subjects: Subjects, settings: WorkerSettings) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self._tasks: set[asyncio.Task[None]] = set()

    def report(self, ev: UsageEvent) -> None:
        """Publish ``ev`` in the background."""
        task = asyncio.create_task(self._publish(ev))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, ev: UsageEvent) -> None:
        w = self.settings
        try:
            await publish_acked(
                self.nc.jetstream(),
                self.subjects.worker_usage,
                encode(ev),
                f"usage-worker-{request_key(ev.origin, ev.request_id)}",
                w.usage_publish_timeout_s,
                w.usage_publish_attempts,
            )
        except Exception as e:  # the gateway's event may still carry it; never fail a stream
            log.warning(
                "usage event publish failed", extra=fields(request_id=ev.request_id, error=repr(e))
            )

    async def flush(self, timeout_s: float) -> None:
        """Wait for usage events still being published (before the connection closes)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
