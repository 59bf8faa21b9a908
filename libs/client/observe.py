"""Observers: follow the fleet's usage events or routing decisions with a consumer of your own.

The events live in the JetStream stream ``settings.nats.events_stream`` (LIMITS retention: every
consumer sees every event, none takes them from another). An observer is a pull consumer on that
stream filtered to ``Subjects.event(kind)``: with ``durable="team-x"`` the server remembers the
position across restarts; without, an ephemeral consumer is deleted when the observer closes.
Each event is acked when the loop asks for the next one, so delivery is at-least-once: an event
being handled when the process dies is delivered again (dedupe by ``request_id``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from libs.client.errors import InvalidRequest, StraitError
from libs.protocol import RouteDecision, Subjects, UsageEvent
from libs.wire.pull import PullEndpoint

log = logging.getLogger("strait.client")

EVENT_TYPES: dict[str, type[UsageEvent] | type[RouteDecision]] = {
    "usage": UsageEvent,
    "route": RouteDecision,
}
# A client polls for events at its own pace (the fleet's loops: libs.wire.pull.FETCH_WAIT_S).
FETCH_WAIT_S = 1.0
# Durable consumers the fleet itself owns: binding to one would take messages from the fleet.
RESERVED_DURABLES = frozenset({"router", "ledger"})


class Observer:
    """Async iterator of ``UsageEvent`` (kind ``usage``) or ``RouteDecision`` (kind ``route``).

    ``deliver="all"`` starts a new consumer at the oldest retained event, ``"new"`` at the next
    one (an existing durable resumes where it left off either way). ``max_idle_s`` ends the
    iteration after that long without an event (None: follow forever).
    """

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        stream: str,
        kind: Literal["usage", "route"],
        durable: str | None = None,
        *,
        deliver: Literal["all", "new"] = "all",
        batch: int = 64,
        max_idle_s: float | None = None,
        ack_wait_s: float = 30.0,
    ) -> None:
        if kind not in EVENT_TYPES:
            raise InvalidRequest(
                f"kind must be one of {sorted(EVENT_TYPES)}, not {kind!r}", param="kind"
            )
        if durable is not None and (not durable or any(c in durable for c in ".*> \t")):
            raise InvalidRequest(
                f"durable name {durable!r} must be non-empty, without '.', '*', '>' or spaces",
                param="durable",
            )
        if durable in RESERVED_DURABLES:
            raise InvalidRequest(
                f"durable {durable!r} belongs to the fleet; sharing it would take its events",
                param="durable",
            )
        self._nc = nc
        self.kind = kind
        self.subject = subjects.event(kind)
        self.stream = stream
        self.durable = durable
        self.deliver = deliver
        self.batch = batch
        self.max_idle_s = max_idle_s
        self.ack_wait_s = ack_wait_s
        self.skipped = 0  # events that failed validation (logged, acked, not yielded)
        self._js: JetStreamContext | None = None
        self._psub: JetStreamContext.PullSubscription | None = None
        self._consumer = ""
        self._iter: AsyncGenerator[UsageEvent | RouteDecision, None] | None = None

    async def __aenter__(self) -> Observer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[UsageEvent | RouteDecision]:
        if self._iter is None:
            self._iter = self._events()
        return self._iter

    async def start(self) -> None:
        """Create (or resume) the consumer and bind to it (idempotent)."""
        if self._psub is not None:
            return
        js = self._js = self._nc.jetstream()
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            raise StraitError(
                f"JetStream stream {self.stream!r} not found (settings nats.events_stream; is the "
                "fleet up?)",
                code="stream_not_found",
            ) from None
        if self.durable is not None:
            self._consumer = self.durable
            try:
                info = await js.consumer_info(self.stream, self.durable)
                if info.config.filter_subject != self.subject:
                    raise StraitError(
                        f"durable {self.durable!r} already follows {info.config.filter_subject!r}; "
                        f"use another name for {self.subject!r}",
                        code="durable_conflict",
                    )
            except NotFoundError:
                await js.add_consumer(self.stream, config=self._config(self.durable))
        else:
            info = await js.add_consumer(self.stream, config=self._config(None))
            self._consumer = info.name
        self._psub = await js.pull_subscribe_bind(
            durable=self._consumer, stream=self.stream, name=self._consumer
        )

    def _config(self, durable: str | None) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            deliver_policy=DeliverPolicy.ALL if self.deliver == "all" else DeliverPolicy.NEW,
            filter_subject=self.subject,
            max_ack_pending=max(self.batch * 4, 256),
            # Ephemeral consumers vanish on their own if the process dies without closing.
            inactive_threshold=None if durable else 60.0,
        )

    async def aclose(self) -> None:
        if self._iter is not None:
            await self._iter.aclose()
        await self._unbind()

    async def _unbind(self) -> None:
        psub, self._psub = self._psub, None
        if psub is None:
            return
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
        if self.durable is None and self._js is not None:
            with contextlib.suppress(Exception):
                await self._js.delete_consumer(self.stream, self._consumer)

    async def _events(self) -> AsyncGenerator[UsageEvent | RouteDecision, None]:
        await self.start()
        assert self._psub is not None
        pull: PullEndpoint[UsageEvent | RouteDecision] = PullEndpoint(
            "observer", EVENT_TYPES[self.kind], self._psub, log, bad="ack"
        )
        last = time.monotonic()
        try:
            while True:
                wait = FETCH_WAIT_S
                if self.max_idle_s is not None:
                    left = self.max_idle_s - (time.monotonic() - last)
                    if left <= 0:
                        return
                    wait = max(min(wait, left), 0.05)
                msgs = await pull.fetch(self.batch, wait)
                if not msgs:
                    continue
                last = time.monotonic()
                for m in msgs:
                    ev = await pull.decode(m)
                    if ev is None:  # logged and acked
                        self.skipped += 1
                        continue
                    yield ev
                    await m.ack()
        finally:
            await self._unbind()
