"""Admission: how a checked ``GenerateRequest`` gets into the fleet from an HTTP route.

One ``Admission`` a gateway process (``app.state.admission``, made by ``create_app``); the
chat, completions and Responses routes call it in this order:

1. ``reserve``: the per-key rate limits (``limits.py``), ``reserved`` tokens held;
2. ``check_capacity``: backpressure, the in-flight bound (``gateway.max_inflight``, a 503) and
   the pool's queue depth (``gateway.shed_queue_depth``, a 429);
3. ``begin``: submit the request (``CompletionRun``) and wait for its first message; the run's
   close gives the in-flight slot back and settles the reservation with the tokens used.

A request that stops between 1 and 3 (a refusal, a cache hit served instead) hands its
reservation back with ``release``. The request itself is built and checked before any of this
(``translate.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from libs.flow.ratelimit import reserve_estimate
from libs.protocol import GenerateRequest, StreamMessage
from libs.settings import GatewaySettings
from services.gateway import metrics
from services.gateway.auth import KeyInfo
from services.gateway.chunks import Kind
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError
from services.gateway.fields import OpenAIFields
from services.gateway.fleet import Fleet
from services.gateway.limits import RateLimiter


class Admission:
    """The rate limits, the backpressure bounds and the in-flight count of one gateway."""

    def __init__(self, g: GatewaySettings, fleet: Fleet, limiter: RateLimiter) -> None:
        self.g = g
        self.fleet = fleet
        self.limiter = limiter
        self.inflight = 0  # requests begun and not yet closed

    def reserve(self, key: KeyInfo, req: GenerateRequest) -> int:
        """Pass ``key``'s rate limits (a 429 when over): the tokens reserved for ``req``."""
        return self.limiter.admit(key, reserve_estimate(req))

    def release(self, key: KeyInfo, reserved: int) -> None:
        """Hand back a reservation whose request never ran (nothing used, not counted)."""
        self.limiter.settle(key, reserved, 0)
        self.limiter.refund_request(key)

    def check_capacity(self, model: str) -> None:
        """Backpressure: a 503 when this gateway holds ``max_inflight`` requests, a 429 when
        ``model``'s pool has ``shed_queue_depth`` queued."""
        g = self.g
        if self.inflight >= g.max_inflight:
            metrics.REJECTED.labels(code="gateway_full").inc()
            raise ApiError(
                503,
                "gateway is at its in-flight limit (gateway.max_inflight)",
                "no_capacity",
                retry_after_s=g.shed_retry_after_s,
            )
        depth = self.fleet.queue_depth(model)
        if depth is not None and depth >= g.shed_queue_depth:
            metrics.REJECTED.labels(code="queue_full").inc()
            raise ApiError(
                429,
                f"{depth} requests are queued for model {model!r} "
                "(gateway.shed_queue_depth); retry later",
                "queue_full",
                retry_after_s=g.shed_retry_after_s,
            )

    async def begin(
        self,
        kind: Kind,
        req: GenerateRequest,
        key: KeyInfo,
        reserved: int,
        include_usage: bool = False,
        fields: OpenAIFields | None = None,
        after_close: Callable[[CompletionRun], None] | None = None,
    ) -> tuple[CompletionRun, StreamMessage]:
        """Past ``reserve`` (``reserved`` tokens): backpressure, then submit the request and
        wait for its first message. The run's close settles the reservation and then calls
        ``after_close`` (the chat routes' cache fill)."""
        try:
            self.check_capacity(req.model)
        except ApiError:
            self.release(key, reserved)
            raise

        def on_close(run: CompletionRun) -> None:
            self._count(-1)
            f = run.outcome.finished
            used = (
                f.usage.total_tokens if f else (reserved if run.outcome.ttft_s is not None else 0)
            )
            self.limiter.settle(key, reserved, used)
            if after_close is not None:
                after_close(run)

        self._count(+1)
        run = CompletionRun(self.fleet, kind, req, key.key_id, include_usage, on_close, fields)
        try:
            first = await run.start()
        except BaseException:
            await asyncio.shield(run.close())
            raise
        return run, first

    def _count(self, delta: int) -> None:
        self.inflight += delta
        metrics.INFLIGHT.set(self.inflight)
