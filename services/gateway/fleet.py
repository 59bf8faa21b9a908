"""The gateway's connection to the fleet: NATS, JetStream, and a live view of the workers.

Created by the app's lifespan; handlers reach it through ``deps.get_fleet``. ``submit`` is the
one way a request leaves the gateway: its reader joins the process's one subscription to
``reply.<gateway_id>.*`` (``mux``), the request goes to the JetStream requests stream with
``reply.<gateway_id>.<request_id>`` as its ``reply_subject``. ``cancel`` tells workers to free a request.
"""

from __future__ import annotations

import logging
import uuid

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from libs.log import fields
from libs.protocol import (
    CancelRequest,
    GenerateRequest,
    KvEvent,
    Subjects,
    UsageEvent,
    WorkerBeat,
    encode,
)
from libs.registry import WorkerRegistry
from libs.settings import Settings
from libs.telemetry import inject_headers
from libs.wire.nats_util import DEDUPE_HEADER, connect, provision, publish_acked
from libs.wire.stream_reader import StreamMux, StreamReader
from services.endpoint import Endpoint, ignores

log = logging.getLogger("strait.gateway")

# Stream messages one request may have waiting in the gateway: every token of every choice
# plus a few control messages, so a fast worker never overruns a slow reader (a dropped
# message would stall the stream). Capped: n (≤ 16) × a 4k context.
STREAM_BUFFER_MAX = 16 * 4096 + 16


class FleetUnavailable(Exception):
    """The request could not be handed to the fleet (NATS or JetStream down)."""


class RequestTooLarge(Exception):
    """The encoded request is over the NATS server's max_payload: the sender's fault (413)."""


class Fleet:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.subjects = Subjects.of(settings.nats)
        self.registry = WorkerRegistry(settings.fleet.worker_ttl_s)
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        # This process's name in its requests' reply subjects (one per process: replicas of
        # the gateway never read each other's streams).
        self.gateway_id = uuid.uuid4().hex[:12]
        self.mux: StreamMux | None = None

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats, "gateway")
        self.js = self.nc.jetstream()
        await provision(self.js, self.settings.nats)
        self.mux = StreamMux(self.nc, self.subjects.reply_streams(self.gateway_id))
        await self.mux.start()
        # Malformed beats and events are the router's to report: ignored here.
        beats = Endpoint("gateway.beat", WorkerBeat, self._on_beat, ignores)
        await beats.subscribe(self.nc, self.subjects.beats_all)
        kv = Endpoint("gateway.kv", KvEvent, self._on_kv, ignores)
        await kv.subscribe(self.nc, self.subjects.kv_events_all)

    async def stop(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    async def _on_beat(self, beat: WorkerBeat, msg: Msg) -> None:
        self.registry.on_beat(beat)

    async def _on_kv(self, ev: KvEvent, msg: Msg) -> None:
        self.registry.on_kv_event(ev)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def live_workers(self) -> int:
        """Live workers of the pools that can serve (a disaggregated pool needs both roles)."""
        self.registry.expire()
        serving = self.registry.serving_pools()
        return sum(1 for v in self.registry.workers.values() if v.beat.pool in serving)

    def addressed(self, req: GenerateRequest) -> GenerateRequest:
        """``req`` streaming to this gateway's reply subject (read through the mux)."""
        return msgspec.structs.replace(
            req, reply_subject=self.subjects.reply_stream(self.gateway_id, req.request_id)
        )

    def reader(self, req: GenerateRequest) -> StreamReader:
        """The reader of an ``addressed`` request's stream; enter it before ``publish``."""
        assert self.nc is not None
        g = self.settings.gateway
        return StreamReader(
            self.nc,
            req.reply_subject or self.subjects.stream(req.request_id),
            g.first_message_timeout_s,
            g.idle_timeout_s,
            max_pending=min(req.sampling.n * req.sampling.max_tokens + 16, STREAM_BUFFER_MAX),
            resend_subject=self.subjects.resend(req.request_id),
            mux=self.mux if req.reply_subject.startswith(self.mux_prefix) else None,
        )

    @property
    def mux_prefix(self) -> str:
        return self.subjects.reply_stream(self.gateway_id, "")

    async def publish(self, req: GenerateRequest) -> None:
        """Put the request on the JetStream requests stream (call inside the reader's context)."""
        if self.js is None or self.nc is None or not self.connected:
            raise FleetUnavailable("not connected to NATS")
        data = encode(req)
        trace = inject_headers()
        sent = {**trace, DEDUPE_HEADER: req.request_id}  # what publish_acked sends
        size = len(data) + sum(len(k) + len(v) + 4 for k, v in sent.items()) + 12
        if size > self.nc.max_payload:
            raise RequestTooLarge(
                f"the request is {size} bytes encoded; the fleet's messages hold at most "
                f"{self.nc.max_payload} (NATS max_payload)"
            )
        try:
            await self._publish_acked(self.subjects.requests, data, req.request_id, trace)
        except Exception as e:
            raise FleetUnavailable(f"could not queue the request: {e!r}") from e

    async def _publish_acked(
        self, subject: str, data: bytes, msg_id: str, headers: dict[str, str] | None = None
    ) -> None:
        """``publish_acked`` with the gateway's timeout and attempts. A busy event loop can
        read an ack seconds late; that is not a lost message (bench/gateway_load.py saw false
        503s at 2000 streams with one 2 s attempt)."""
        assert self.js is not None
        g = self.settings.gateway
        await publish_acked(
            self.js, subject, data, msg_id, g.publish_ack_timeout_s, g.publish_attempts, headers
        )

    async def cancel(self, request_id: str, reason: str) -> None:
        if self.nc is None or not self.connected:
            return
        try:
            await self.nc.publish(
                self.subjects.cancel(request_id),
                encode(CancelRequest(request_id=request_id, reason=reason)),
            )
        except Exception as e:
            log.warning("cancel publish failed", extra=fields(request_id=request_id, error=repr(e)))

    async def usage(self, ev: UsageEvent) -> None:
        """Hand the usage event to the ledger stream (JetStream, so it survives a DB outage)."""
        if self.js is None:
            return
        try:
            await self._publish_acked(
                self.subjects.event("usage"), encode(ev), f"usage-{ev.request_id}"
            )
        except Exception as e:
            log.error(
                "usage event publish failed", extra=fields(request_id=ev.request_id, error=repr(e))
            )

    def pools_for(self, model: str) -> set[str]:
        """The pools a request for ``model`` may land in (as the router resolves it)."""
        configured = {p.name: p.model for p in self.settings.pools}
        live = self.registry.pools()
        if model in configured or model in live:
            return {model}
        by_model = {m: p for p, m in configured.items()} | self.registry.model_pools()
        if model in by_model:
            return {by_model[model]}
        if model == "auto":
            return set(configured) | live
        return set()

    def queue_depth(self, model: str) -> int | None:
        """Waiting requests ahead of ``model``: the least loaded of its pools that has live
        workers (sum of ``waiting`` in their beats); None when no such pool is live."""
        depths = [
            sum(w.beat.waiting for w in workers)
            for workers in (self.registry.live(p) for p in self.pools_for(model))
            if workers
        ]
        return min(depths) if depths else None
