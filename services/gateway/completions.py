"""One completion request through the fleet, as the OpenAI API shapes it.

``CompletionRun`` is built by ``Admission.begin`` for the HTTP routes (``routes/``); it addresses
the request to this gateway's reply subject (``Fleet.addressed``). ``start`` registers the
request's reader with the gateway's one stream subscription (``Fleet.mux``), publishes the
``GenerateRequest`` inside the ``gateway.request`` span (so the traceparent rides along) and
waits for the first token (an error before any token is a plain HTTP error, even for
``stream=true``); then ``sse`` streams chunks or ``collect`` builds the whole response (their
shapes: ``chunks.py``). ``close`` always runs once: it cancels an unfinished request (client
gone), publishes the ``UsageEvent`` for the ledger, ends the span and calls the route's
``on_close`` hook (in-flight count, rate-limit settlement, cache fill).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry import trace

from libs.engine.tools import CallMarkupFilter
from libs.log import fields
from libs.protocol import (
    ErrorMessage,
    Finished,
    GenerateRequest,
    Migrated,
    Routed,
    StreamMessage,
    TokenDelta,
    UsageEvent,
)
from libs.telemetry import tracer
from libs.wire.stream_reader import StreamGap, StreamReader
from services.gateway import metrics
from services.gateway.chunks import (
    Accumulator,
    ChunkShaper,
    Kind,
    SseResponse,
    finished_usage,
    logprobs_json,
)
from services.gateway.errors import ApiError
from services.gateway.fields import OpenAIFields
from services.gateway.fleet import Fleet, FleetUnavailable, RequestTooLarge

log = logging.getLogger("strait.gateway")
_tracer = tracer("strait.gateway")


@dataclass
class Outcome:
    """What the gateway learned about one request, for the ledger and the log line."""

    request_id: str
    api_key_id: str | None
    model: str
    team: str | None = None
    started: float = field(default_factory=time.perf_counter)
    created_at: float = field(default_factory=time.time)
    ttft_s: float | None = None
    status: Literal["ok", "error", "cancelled"] = "ok"
    error_code: str | None = None
    error: str | None = None
    finished: Finished | None = None
    route_code: str = ""
    route_factors: list[str] = field(default_factory=list)
    migrations: int = 0  # times the router moved the request to another worker mid-stream

    def usage_event(self) -> UsageEvent:
        f = self.finished
        return UsageEvent(
            request_id=self.request_id,
            api_key_id=self.api_key_id,
            team=self.team,
            pool=f.pool if f else "",
            model=f.model if f else self.model,
            worker_id=f.worker_id if f else "",
            route_code=self.route_code,
            route_factors=self.route_factors,
            prompt_tokens=f.usage.prompt_tokens if f else 0,
            completion_tokens=f.usage.completion_tokens if f else 0,
            cached_tokens=f.usage.cached_tokens if f else 0,
            queued_s=f.timings.queued_s if f else 0.0,
            ttft_s=self.ttft_s,
            total_s=time.perf_counter() - self.started,
            status=self.status,
            error_code=self.error_code,
            error=self.error,
            created_at=self.created_at,
        )


def new_request_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


class CompletionRun:
    """Drives one request: submit → first message → stream or collect → close."""

    def __init__(
        self,
        fleet: Fleet,
        kind: Kind,
        req: GenerateRequest,
        api_key_id: str | None,
        include_usage: bool,
        on_close: Callable[[CompletionRun], None] | None = None,
        fields: OpenAIFields | None = None,
    ) -> None:
        """``fields``: names a worker's error param as the body field the client sent
        (default: the plain ``kind`` body's)."""
        self.fleet = fleet
        self.fields = fields or OpenAIFields(kind)
        self.kind = kind
        self.req = req = fleet.addressed(req)
        self.outcome = Outcome(req.request_id, api_key_id, req.model, req.team)
        self.created = int(time.time())
        self.shaper = ChunkShaper(kind, req.request_id, self.created, req.model, include_usage)
        self.acc = Accumulator(req.sampling.n)
        self.on_close = on_close
        self.stack = AsyncExitStack()
        self.messages: AsyncIterator[StreamMessage] | None = None
        self.reader: StreamReader | None = None
        self.done = False
        self.span = _tracer.start_span(
            "gateway.request",
            attributes={
                "strait.request_id": req.request_id,
                "strait.model": req.model,
                "strait.kind": kind,
            },
        )

    async def start(self) -> StreamMessage:
        """Submit and wait for the first message; raises ApiError for an early failure."""
        reader = self.reader = self.fleet.reader(self.req)
        await self.stack.enter_async_context(reader)
        try:
            with trace.use_span(self.span, end_on_exit=False):
                await self.fleet.publish(self.req)
        except RequestTooLarge as e:
            await self.fail("request_too_large", str(e))
            raise ApiError(413, str(e), "request_too_large") from e
        except FleetUnavailable as e:
            await self.fail("no_worker", str(e))
            raise ApiError(
                503, "the serving fleet is unavailable; retry shortly", "no_worker", retry_after_s=2
            ) from e
        self.messages = reader.messages()
        first = await self.next_message()
        if isinstance(first, Routed):
            self.outcome.route_code = first.route.code
            self.outcome.route_factors = first.route.factors
            self.span.set_attribute("strait.pool", first.route.pool)
            self.span.set_attribute("strait.worker_id", first.route.worker_id)
            # Chunks name the model that answers (as vLLM does), not "auto" or a pool name.
            served = self.fleet.registry.pool_model.get(first.route.pool)
            if served:
                self.shaper.model = served
            first = await self.next_message()
        if isinstance(first, ErrorMessage):
            await self.fail(first.code, first.message)
            err = ApiError.from_stream(first)
            err.param = self.fields.of(err.param)
            raise err
        return first

    async def next_message(self) -> StreamMessage:
        assert self.messages is not None
        try:
            msg = await anext(self.messages)
            while isinstance(msg, Migrated):
                # The router moved the request to another worker; the stream goes on.
                metrics.MIGRATIONS.inc()
                self.outcome.migrations += 1
                self.span.add_event(
                    "migrated",
                    {"strait.from_worker": msg.from_worker, "strait.tokens": msg.num_tokens},
                )
                msg = await anext(self.messages)
            return msg
        except TimeoutError:
            await self.fleet.cancel(self.req.request_id, "gateway_timeout")
            await self.fail("timeout", "timed out waiting for the worker")
            raise ApiError(504, "timed out waiting for the model", "timeout") from None
        except StreamGap as e:
            await self.fail("internal_error", str(e))
            raise ApiError(500, "the token stream lost a message", "internal_error") from None
        except StopAsyncIteration:
            await self.fail("internal_error", "stream ended early")
            raise ApiError(500, "the token stream ended early", "internal_error") from None

    async def fail(self, code: str, message: str) -> None:
        self.outcome.status = "error"
        self.outcome.error_code = code
        self.outcome.error = message
        await self.close()

    def response_body(self) -> dict[str, Any] | None:
        """The whole (non-streaming) response, once the request finished."""
        f = self.outcome.finished
        if f is None or self.outcome.status != "ok":
            return None
        return self.acc.body(self.kind, self.req.request_id, self.created, self.shaper.model, f)

    async def close(self) -> None:
        """Idempotent end of the request: cancel if unfinished, usage event, span, log, hook."""
        if self.done:
            return
        self.done = True
        await self.stack.aclose()
        o = self.outcome
        if o.status == "ok" and o.finished is None:
            o.status, o.error_code = "cancelled", "client_disconnected"
            await self.fleet.cancel(self.req.request_id, "client_disconnected")
        ev = o.usage_event()
        await self.fleet.usage(ev)
        metrics.REQUESTS.labels(kind=self.kind, status=o.status).inc()
        metrics.E2E.observe(ev.total_s)
        self.span.set_attribute("strait.status", o.status)
        if o.status != "ok":
            self.span.set_status(trace.StatusCode.ERROR, o.error_code or o.status)
        self.span.end()
        log.info(
            "request",
            extra=fields(
                request_id=o.request_id,
                kind=self.kind,
                model=self.req.model,
                status=o.status,
                error=o.error_code,
                pool=ev.pool,
                worker_id=ev.worker_id,
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens,
                ttft_s=round(o.ttft_s, 4) if o.ttft_s else None,
                total_s=round(ev.total_s, 4),
                migrations=o.migrations or None,
            ),
        )
        if self.on_close is not None:
            self.on_close(self)

    def _on_delta(self, d: TokenDelta) -> None:
        if self.outcome.ttft_s is None:
            self.outcome.ttft_s = time.perf_counter() - self.outcome.started
            metrics.TTFT.observe(self.outcome.ttft_s)
        metrics.OUTPUT_TOKENS.inc(len(d.token_ids))
        self.acc.add(d)

    # ---------------------------------------------------------------- streaming

    async def sse(self, first: StreamMessage) -> AsyncIterator[bytes]:
        """SSE lines for every stream message. Lines of messages that are already waiting in
        the reader go out as one write: at thousands of streams a socket write per token was
        the gateway's largest cost (bench/gateway_load.py's profile)."""
        started: set[int] = set()
        # Requests whose calls are reported: text that may start a call's markup is held back.
        filters = (
            [CallMarkupFilter() for _ in range(self.req.sampling.n)]
            if self.kind == "chat"
            and self.req.tools
            and (self.req.tool_choice != "none" or self.req.tool_name)
            else None
        )
        out: list[bytes] = []
        msg: StreamMessage = first
        try:
            while True:
                if isinstance(msg, TokenDelta):
                    self._on_delta(msg)
                    text = msg.text
                    f = filters[msg.index] if filters and 0 <= msg.index < len(filters) else None
                    if f is not None:
                        text = f.feed(text)
                        if msg.finish_reason is not None:
                            text += f.flush(calls_made=bool(msg.tool_calls))
                    if text or msg.index not in started or msg.logprobs:
                        lp = logprobs_json(self.kind, msg.logprobs)
                        out.append(self.shaper.delta(msg.index, text, msg.index not in started, lp))
                        started.add(msg.index)
                    if msg.tool_calls:
                        out.append(self.shaper.tool_calls(msg.index, msg.tool_calls, False))
                    if msg.finish_reason is not None:
                        out.append(self.shaper.finish(msg.index, msg.finish_reason))
                elif isinstance(msg, Finished):
                    self.outcome.finished = msg
                    if self.shaper.include_usage:
                        out.append(self.shaper.usage(finished_usage(msg)))
                    out.append(self.shaper.DONE)
                    break
                elif isinstance(msg, ErrorMessage):
                    await self.fail(msg.code, msg.message)
                    out.append(self.shaper.error(ApiError.from_stream(msg)))
                    break
                if out and not (self.reader is not None and self.reader.pending):
                    yield b"".join(out)
                    out.clear()
                msg = await self.next_message()
            yield b"".join(out)
        except ApiError as e:
            out.append(self.shaper.error(e))
            yield b"".join(out)
        finally:
            # Runs on normal end and when the client disconnects (the generator is closed).
            await asyncio.shield(self.close())

    def streaming_response(self, first: StreamMessage, headers: dict[str, str]) -> SseResponse:
        return SseResponse(
            self.sse(first), self.close, {"X-Request-Id": self.req.request_id, **headers}
        )

    async def deltas(self, first: StreamMessage) -> AsyncIterator[TokenDelta]:
        """The request's token deltas to its end (``outcome.finished`` set); an error on the
        stream raises ``ApiError``. For shapes other than chat's (``responses.py``); the caller
        closes the run."""
        msg = first
        while True:
            if isinstance(msg, TokenDelta):
                self._on_delta(msg)
                yield msg
            elif isinstance(msg, Finished):
                self.outcome.finished = msg
                return
            elif isinstance(msg, ErrorMessage):
                await self.fail(msg.code, msg.message)
                raise ApiError.from_stream(msg)
            msg = await self.next_message()

    # ---------------------------------------------------------------- whole response

    async def collect(self, first: StreamMessage) -> dict[str, Any]:
        msg = first
        try:
            while True:
                if isinstance(msg, TokenDelta):
                    self._on_delta(msg)
                elif isinstance(msg, Finished):
                    self.outcome.finished = msg
                    break
                elif isinstance(msg, ErrorMessage):
                    await self.fail(msg.code, msg.message)
                    raise ApiError.from_stream(msg)
                msg = await self.next_message()
        finally:
            await asyncio.shield(self.close())
        body = self.response_body()
        assert body is not None
        return body
