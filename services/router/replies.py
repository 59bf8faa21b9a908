"""What the router sends: an ``Assignment`` offered to one worker (``offer``: request/reply
on the worker's subject, within ``router.assign_timeout_s``), a placement recorded (``record``:
metrics, a ``RouteDecision`` on the events stream, the one log line), a request's stream ended
with a typed error (``reply_error``), and the answer to a malformed request message (on its
stream when its id can be read, else a dead letter). ``Router`` inherits them.
"""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from libs.log import fields
from libs.protocol import (
    Assignment,
    AssignmentAck,
    ErrorMessage,
    GenerateRequest,
    Migration,
    ProtocolError,
    RouteDecision,
    RouteReason,
    Subjects,
    encode,
)
from libs.settings import RouterSettings
from libs.telemetry import inject_headers
from services.deadletter import dead_letter
from services.router import metrics
from services.router.decision import Rejection
from services.router.flow import TenantFlow
from services.router.teams import TeamPolicy
from services.router.watch import StreamWatch

log = logging.getLogger("strait.router")


class Replies:
    """Mixed into ``Router``, which sets these attributes in its ``__init__``."""

    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    cfg: RouterSettings
    watch: StreamWatch
    teams: TeamPolicy
    flow: TenantFlow

    def stream_subject(self, req: GenerateRequest) -> str:
        return req.reply_subject or self.subjects.stream(req.request_id)

    async def offer(
        self,
        req: GenerateRequest,
        route: RouteReason,
        attempt: int,
        queued_s: float,
        decode_workers: list[str] | None = None,
        migration: Migration | None = None,
    ) -> bool | None:
        """Offer ``req`` to one worker: True it accepted, False it refused, None no answer
        within ``router.assign_timeout_s`` (or no one listens on its subject)."""
        a = Assignment(
            request=req,
            route=route,
            attempt=attempt,
            queued_s=queued_s,
            decode_workers=decode_workers or [],
            migration=migration,
        )
        try:
            reply = await self.nc.request(
                self.subjects.work(route.worker_id),
                encode(a),
                timeout=self.cfg.assign_timeout_s,
                headers=inject_headers(),
            )
        except (NatsTimeout, NoRespondersError, TimeoutError):
            log.warning(
                "worker did not answer",
                extra=fields(request_id=req.request_id, worker_id=route.worker_id),
            )
            return None
        try:
            ack = msgspec.json.decode(reply.data, type=AssignmentAck)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        return ack.accepted

    async def record(self, req: GenerateRequest, route: RouteReason, decision_s: float) -> None:
        """The decision's reason in metrics, the events stream and the log."""
        metrics.DECISIONS.labels(pool=route.pool, reason=route.code).inc()
        metrics.DECISION_SECONDS.observe(decision_s)
        metrics.OVERLAP_BLOCKS.observe(route.overlap_blocks)
        if route.cross_region:
            metrics.CROSS_REGION.labels(region=route.region, reason=route.cross_region).inc()
        ev = RouteDecision(
            request_id=req.request_id, origin=req.origin, route=route, decision_s=decision_s
        )
        try:
            await self.js.publish(self.subjects.event("route"), encode(ev), timeout=1.0)
        except Exception as e:  # the event stream is for observers; never block routing on it
            log.warning("route event publish failed", extra=fields(error=repr(e)))
        tenant, counter = self.flow.describe(req)
        if counter is not None:
            metrics.TENANT_COUNTER.labels(pool=route.pool, tenant=metrics.tenant_label(tenant)).set(
                counter
            )
        log.info(
            "routed",
            extra=fields(
                request_id=req.key,
                tenant=tenant,
                tenant_counter=None if counter is None else round(counter, 1),
                pool=route.pool,
                worker_id=route.worker_id,
                reason=route.code,
                score=route.score,
                factors=route.factors,
                overlap_blocks=route.overlap_blocks,
                cost=route.cost,
                region=route.region or None,
                cross_region=route.cross_region or None,
                decision_ms=round(decision_s * 1000, 3),
            ),
        )

    async def reply_error(self, req: GenerateRequest, r: Rejection) -> None:
        """End ``req``'s stream with a typed error (after whatever it already carried)."""
        metrics.REJECTED.labels(code=r.code).inc()
        tenant, _ = self.flow.describe(req)
        if r.code in ("over_share", "deadline_exceeded"):
            label = metrics.tenant_label(tenant)
            pool = self.flow.pool_of(req)
            metrics.FLOW_REFUSED.labels(pool=pool, tenant=label, code=r.code).inc()
        log.info(
            "rejected",
            extra=fields(request_id=req.request_id, tenant=tenant, code=r.code, error=r.message),
        )
        seq = self.watch.next_seq(req.key)
        await self.watch.forget(req.key)
        self.flow.ended(req, None)  # when the watch did not hold it (already ended: a no-op)
        err = ErrorMessage(
            seq=seq,
            request_id=req.request_id,
            code=r.code,
            message=r.message,
            param=r.param,
            retry_after_s=r.retry_after_s,
        )
        await self.nc.publish(self.stream_subject(req), encode(err))

    async def _reject_malformed(self, msg: Msg, e: ProtocolError) -> None:
        metrics.REJECTED.labels(code=e.code).inc()
        if e.request_id:  # usable as a subject token (ProtocolError keeps no other)
            err = ErrorMessage(seq=1, request_id=e.request_id, code=e.code, message=str(e))
            team = self.teams.sender(msg.subject)
            subject = (
                self.subjects.stream(e.request_id)
                if team is None
                else self.subjects.team_stream(team, e.request_id)
            )
            await self.nc.publish(subject, encode(err))
        else:
            await dead_letter(self.nc, self.subjects, msg, str(e), "router")
