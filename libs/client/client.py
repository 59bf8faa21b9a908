"""``StraitClient``: internal teams' asyncio client for the NATS API (docs/nats-api.md).

One request, over the wire::

    subscribe <prefix>.stream.<request_id>         (before publishing, so nothing is missed)
    JetStream publish GenerateRequest → <prefix>.requests   (PubAck: the request is queued)
    read Routed? TokenDelta* (Finished | ErrorMessage) in seq order
    on early close / timeout: publish CancelRequest → <prefix>.cancel.<request_id>
    at the end (report_usage): JetStream publish UsageEvent → <prefix>.events.usage

``generate`` returns a :class:`Generation`: an async iterator of ``TokenDelta`` whose ``finished``
/ ``usage`` are set once the stream ends; ``complete`` collects it into a :class:`Completion`.
Errors are raised as the typed exceptions of ``libs.client.errors``.

Over 500 lines because it is the public client in one import: the connection, the request
builder and the ``Generation`` iterator, whose options and docstrings are the API's reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack, cast

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import MaxPayloadError, NoRespondersError
from nats.js.errors import NoStreamResponseError

from libs.client.errors import (
    FleetUnavailable,
    IncompleteStream,
    InvalidRequest,
    PayloadTooLarge,
    StraitError,
    Timeout,
    error_from_message,
)
from libs.client.observe import Observer
from libs.client.respond import (
    InputItems,
    Response,
    ResponseOptions,
    ToolChoiceLike,
    request_options,
    response_of,
)
from libs.protocol import (
    CancelRequest,
    ChatMessage,
    ErrorMessage,
    Finished,
    FinishReason,
    GenerateRequest,
    Migrated,
    Priority,
    ProtocolError,
    Routed,
    RouteReason,
    SamplingParams,
    StreamMessage,
    StructuredOutput,
    Subjects,
    TokenDelta,
    ToolCall,
    ToolChoice,
    ToolFunction,
    Usage,
    UsageEvent,
    decode,
    encode,
    validate_request,
)
from libs.telemetry import inject_headers
from libs.wire.nats_util import DEDUPE_HEADER, auth_options, publish_acked, server_urls
from libs.wire.stream_reader import StreamGap, StreamMux, StreamReader

log = logging.getLogger("strait.client")

DEFAULT_URL = "nats://127.0.0.1:4222"
MessageLike = ChatMessage | Mapping[str, Any]


class RequestOptions(TypedDict, total=False):
    """Fields of one request, named as in the HTTP API (see ``SamplingParams`` for ranges)."""

    model: str
    messages: Sequence[MessageLike]
    prompt_token_ids: Sequence[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    seed: int | None
    n: int
    logprobs: int | None
    ignore_eos: bool
    # Speculative decoding's depth for this request, a ceiling under the pool's (0: off).
    num_speculative_tokens: int | None
    # A predicted output (text the answer should repeat, e.g. the code being edited): faster
    # answers when it is right, the same answer either way (OpenAI's prediction.content).
    prediction: str | None
    logit_bias: Mapping[int | str, float]
    # A grammar the output follows: a StructuredOutput or its dict (json / regex / choice /
    # grammar), as in docs/structured-outputs.md.
    structured: StructuredOutput | Mapping[str, Any]
    tools: Sequence[ToolFunction | Mapping[str, Any]]
    tool_choice: ToolChoice
    tool_name: str | None
    parallel_tool_calls: bool
    priority: Priority
    user: str | None
    request_id: str
    want_route: bool
    first_token_timeout_s: float
    idle_timeout_s: float


_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


@dataclass
class Completion:
    """The whole result of one request (``complete``): text per choice and the final usage."""

    request_id: str
    texts: list[str]
    finish_reasons: list[FinishReason | None]
    finished: Finished
    route: RouteReason | None = None
    token_ids: list[list[int]] = field(default_factory=list)
    # Per choice: the calls it ended with (finish_reason "tool_calls"), else None.
    tool_calls: list[list[ToolCall] | None] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def usage(self) -> Usage:
        return self.finished.usage


class StraitClient:
    """A client of the fleet over NATS. Use as ``async with StraitClient(url) as client:``.

    ``nc`` is a nats-py connection (the caller keeps owning it) or a URL (the client connects on
    ``__aenter__``/``connect()`` and closes on exit); unset, ``NATS_URL`` or the local default. ``api_key_id`` is stamped on every request
    and usage event as a label; it is *not* a credential (see docs/nats-api.md,
    "Authentication"). ``max_payload`` caps request size below the server's own limit.

    Credentials for a secured fleet (docs/security.md), used when the client connects itself:
    ``nkey_seed_file`` (the team's ``.nk`` file from ``strait teams add``) and ``tls_ca_file``
    (plus ``tls_cert_file``/``tls_key_file`` where the server verifies clients). Each defaults
    to the environment variable the ``nats`` CLI reads: ``NATS_NKEY``, ``NATS_CA``,
    ``NATS_CERT``, ``NATS_KEY``. ``report_usage`` defaults to on without an nkey and off with
    one: a team's account cannot publish usage events; the fleet records its usage itself.

    ``reply_mux`` (default: as ``report_usage``, i.e. on for the fleet's own account): the
    client names ``<prefix>.reply.<client id>.<request_id>`` as each request's
    ``reply_subject`` and reads all its streams through one subscription to
    ``<prefix>.reply.<client id>.*``, instead of one subscription (and a server round trip) per
    request to ``<prefix>.stream.<request_id>``. Off for a team: the fleet sends a team's
    tokens to its ``stream.<request_id>`` whatever the request names.
    """

    def __init__(
        self,
        nc: NATS | str | None = None,
        *,
        prefix: str = "strait.v1",
        region: str = "",
        api_key_id: str | None = None,
        events_stream: str = "STRAIT_EVENTS",
        max_payload: int | None = None,
        first_token_timeout_s: float = 120.0,
        idle_timeout_s: float = 60.0,
        report_usage: bool | None = None,
        name: str = "strait-client",
        nkey_seed_file: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        publish_ack_timeout_s: float = 5.0,
        publish_attempts: int = 3,
        reply_mux: bool | None = None,
    ) -> None:
        if nc is None:  # the nats CLI's variable, then the local default
            nc = os.environ.get("NATS_URL") or DEFAULT_URL
        self._nc: NATS | None = None if isinstance(nc, str) else nc
        self._url = nc if isinstance(nc, str) else ""
        self._owns_connection = isinstance(nc, str)
        # A region's clients send to its requests stream and report usage to its events
        # (docs/regions.md); their streams come back from whichever region ran them.
        self.subjects = Subjects(prefix, region)
        self.api_key_id = api_key_id
        self.events_stream = events_stream
        self.max_payload = max_payload
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        env = os.environ.get
        self.nkey_seed_file = env("NATS_NKEY", "") if nkey_seed_file is None else nkey_seed_file
        self.tls_ca_file = env("NATS_CA", "") if tls_ca_file is None else tls_ca_file
        self.tls_cert_file = env("NATS_CERT", "") if tls_cert_file is None else tls_cert_file
        self.tls_key_file = env("NATS_KEY", "") if tls_key_file is None else tls_key_file
        self.report_usage = not self.nkey_seed_file if report_usage is None else report_usage
        self.name = name
        # A request or usage event is published up to publish_attempts times under one
        # Nats-Msg-Id (stored once) when its ack does not come within publish_ack_timeout_s.
        self.publish_ack_timeout_s = publish_ack_timeout_s
        self.publish_attempts = publish_attempts
        self.reply_mux = self.report_usage if reply_mux is None else reply_mux
        self.client_id = uuid.uuid4().hex[:12]  # <reader> in this client's reply subjects
        self._mux: StreamMux | None = None
        self._mux_nc: NATS | None = None  # the connection the mux subscribed on
        self._mux_lock = asyncio.Lock()

    @classmethod
    def from_settings(cls, settings: Any, nc: NATS | None = None, **kwargs: Any) -> StraitClient:
        """A client configured like the fleet: prefix, events stream, max_payload, timeouts, and
        the fleet's own credentials when its settings name them (it reports usage)."""
        n, g = settings.nats, settings.gateway
        kwargs.setdefault("first_token_timeout_s", g.first_message_timeout_s)
        kwargs.setdefault("idle_timeout_s", g.idle_timeout_s)
        kwargs.setdefault("report_usage", True)
        for opt in ("nkey_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(n, opt):
                kwargs.setdefault(opt, getattr(n, opt))
        return cls(
            nc if nc is not None else n.url,
            prefix=n.subject_prefix,
            region=n.region,
            events_stream=n.events_stream,
            max_payload=n.max_payload,
            **kwargs,
        )

    # ------------------------------------------------------------ connection

    async def connect(self) -> StraitClient:
        if self._nc is None:
            self._nc = await nats.connect(
                servers=server_urls(self._url),
                name=self.name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                **auth_options(
                    self.nkey_seed_file, self.tls_ca_file, self.tls_cert_file, self.tls_key_file
                ),
            )
        return self

    async def close(self) -> None:
        if self._mux is not None:
            mux, self._mux, self._mux_nc = self._mux, None, None
            if not self._owns_connection and self._nc is not None and not self._nc.is_closed:
                await mux.stop()  # the caller's connection lives on
        if self._owns_connection and self._nc is not None and not self._nc.is_closed:
            if self._nc.is_connected:
                await self._nc.drain()
            else:  # reconnecting (the server restarts, or refuses a revoked team): just stop
                # NOTE: nats-py's close of a TLS connection that is reconnecting can raise from
                # its transport (a closed SSL protocol); the connection is closed either way.
                with contextlib.suppress(Exception):
                    await self._nc.close()
        if self._owns_connection:
            self._nc = None

    async def __aenter__(self) -> StraitClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise StraitError(
                "not connected: use `async with StraitClient(...)` or `await connect()`",
                code="not_connected",
            )
        return self._nc

    # ------------------------------------------------------------ requests

    def request(self, prompt: str | None = None, **opts: Unpack[RequestOptions]) -> GenerateRequest:
        """The ``GenerateRequest`` that ``generate`` would publish (validated; raises InvalidRequest)."""
        fields: dict[str, Any] = dict(opts)
        for key in ("first_token_timeout_s", "idle_timeout_s"):
            fields.pop(key, None)
        sampling = {k: fields.pop(k) for k in list(fields) if k in _SAMPLING_FIELDS}
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        for key in ("stop", "stop_token_ids"):
            if key in sampling:
                sampling[key] = list(sampling[key])
        messages = fields.pop("messages", None)
        ids = fields.pop("prompt_token_ids", None)
        raw: dict[str, Any] = {
            "request_id": fields.pop("request_id", None) or f"nats-{uuid.uuid4().hex}",
            "prompt": prompt,
            "prompt_token_ids": list(ids) if ids is not None else None,
            "messages": None if messages is None else [_message(m) for m in messages],
            "sampling": sampling,
            "api_key_id": self.api_key_id,
            **fields,
        }
        try:
            # Round trip through the wire decoder: the same checks the router makes, before sending.
            req = decode(msgspec.json.encode(raw), GenerateRequest)
            validate_request(req)
        except ProtocolError as e:
            raise InvalidRequest(str(e), request_id=str(raw["request_id"])) from None
        return req

    def generate(self, prompt: str | None = None, **opts: Unpack[RequestOptions]) -> Generation:
        """Start streaming one request: ``async with client.generate(...) as gen: async for d in gen``.

        Yields ``TokenDelta``s (``.index`` is the choice when ``n > 1``); afterwards
        ``gen.finished`` / ``gen.usage`` hold the final message. Leaving early cancels the request.
        """
        first = opts.get("first_token_timeout_s", self.first_token_timeout_s)
        idle = opts.get("idle_timeout_s", self.idle_timeout_s)
        return Generation(self, self.request(prompt, **opts), first, idle)

    async def complete(
        self, prompt: str | None = None, **opts: Unpack[RequestOptions]
    ) -> Completion:
        """Run one request to the end and return its text(s) and usage."""
        async with self.generate(prompt, **opts) as gen:
            n = gen.request.sampling.n
            texts = [""] * n
            reasons: list[FinishReason | None] = [None] * n
            token_ids: list[list[int]] = [[] for _ in range(n)]
            calls: list[list[ToolCall] | None] = [None] * n
            async for d in gen:
                texts[d.index] += d.text
                token_ids[d.index].extend(d.token_ids)
                if d.finish_reason is not None:
                    reasons[d.index] = d.finish_reason
                if d.tool_calls:
                    calls[d.index] = d.tool_calls
        assert gen.finished is not None
        return Completion(gen.request_id, texts, reasons, gen.finished, gen.route, token_ids, calls)

    async def respond(
        self,
        input: InputItems,
        *,
        instructions: str | None = None,
        tools: Sequence[ToolFunction | Mapping[str, Any]] | None = None,
        tool_choice: ToolChoiceLike = None,
        text_format: Mapping[str, Any] | None = None,
        max_output_tokens: int | None = None,
        **opts: Unpack[ResponseOptions],
    ) -> Response:
        """One request in the Responses API's terms (``libs.client.respond``): ``input`` as
        text or items, ``instructions``, function ``tools`` as Responses writes them,
        ``tool_choice``, ``text_format`` (``text.format``) and ``max_output_tokens``; the answer
        as output items. ``response.follow_up({call_id: output})`` is the next turn's input."""
        fields = request_options(
            input, instructions, tools, tool_choice, text_format, max_output_tokens
        )
        done = await self.complete(**cast(RequestOptions, {**fields, **opts}))
        return response_of(
            done.request_id,
            input,
            done.text,
            done.finish_reasons[0],
            done.tool_calls[0],
            done.finished,
        )

    def submit_raw(
        self, payload: bytes, request_id: str, *, first_token_timeout_s: float = 10.0
    ) -> Generation:
        """Publish ``payload`` as-is and read ``request_id``'s stream: for probing bad input.

        The fleet answers a malformed request that names a usable ``request_id`` with a typed
        ``ErrorMessage`` on that request's stream; this raises it like ``generate`` would.
        """
        req = GenerateRequest(request_id=request_id, prompt="")
        return Generation(self, req, first_token_timeout_s, first_token_timeout_s, payload=payload)

    async def cancel(self, request_id: str, reason: str = "client_cancelled") -> None:
        """Ask the worker running ``request_id`` to stop and free its blocks (fire and forget)."""
        msg = CancelRequest(request_id=request_id, reason=reason)
        await self.nc.publish(self.subjects.cancel(request_id), encode(msg))

    def observe(
        self,
        kind: Literal["usage", "route"],
        durable: str | None = None,
        *,
        deliver: Literal["all", "new"] = "all",
        batch: int = 64,
        max_idle_s: float | None = None,
    ) -> Observer:
        """Iterate the fleet's usage events or routing decisions with a consumer of your own."""
        return Observer(
            self.nc,
            self.subjects,
            self.events_stream,
            kind,
            durable,
            deliver=deliver,
            batch=batch,
            max_idle_s=max_idle_s,
        )

    async def reply_reader(self) -> StreamMux | None:
        """The client's reply mux (subscribed on first use), or None with ``reply_mux`` off."""
        if not self.reply_mux:
            return None
        nc = self.nc
        async with self._mux_lock:
            if self._mux is None or self._mux_nc is not nc:
                mux = StreamMux(nc, self.subjects.reply_streams(self.client_id))
                await mux.start()
                self._mux, self._mux_nc = mux, nc
            return self._mux

    def payload_limit(self) -> int:
        """Bytes a request may take: the server's ``max_payload``, or ours when smaller."""
        server = self.nc.max_payload
        return min(server, self.max_payload) if self.max_payload else server


def _message(m: MessageLike) -> Any:
    """A message as the wire has it (a ChatMessage, or a dict with its fields)."""
    if isinstance(m, ChatMessage):
        return m
    return dict(m)


def _headers_size(headers: Mapping[str, str]) -> int:
    """Bytes NATS counts for ``headers`` against max_payload ("NATS/1.0\\r\\n", "k: v\\r\\n"…, "\\r\\n")."""
    return 10 + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2 if headers else 0


class Generation:
    """One request's token stream; see ``StraitClient.generate``.

    An async iterator of ``TokenDelta`` and an async context manager. The request is published
    on ``__aenter__`` (or the first ``__anext__``); leaving before the end — ``break``, an
    exception, a timeout, task cancellation — publishes a ``CancelRequest`` so the worker frees it.
    """

    def __init__(
        self,
        client: StraitClient,
        request: GenerateRequest,
        first_token_timeout_s: float,
        idle_timeout_s: float,
        payload: bytes | None = None,
    ) -> None:
        self.client = client
        self.request = request
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._payload = payload
        self.finished: Finished | None = None
        self.route: RouteReason | None = None
        self.migrations = 0  # times the fleet moved the request to another worker mid-stream
        # Each move's reason (Migrated.reason): "worker_lost", or "waiting_for_worker" when the
        # stream paused for a worker of its pool to come back.
        self.migration_reasons: list[str] = []
        self.error: StraitError | None = None
        self.ttft_s: float | None = None
        self._reader: StreamReader | None = None
        # Weak: the generator's frame holds this object, and a cycle would keep an abandoned
        # stream (``break`` out of ``async for`` without ``async with``) alive until the cyclic
        # GC, delaying its cancel. With a weak reference it is finalized, and cancelled, at once.
        self._iter: weakref.ref[AsyncGenerator[TokenDelta, None]] | None = None
        self._started_at = 0.0
        self._done = False
        self._ending: asyncio.Future[None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def usage(self) -> Usage | None:
        """Token counts from the final ``Finished`` message (None until the stream has ended)."""
        return self.finished.usage if self.finished is not None else None

    async def __aenter__(self) -> Generation:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        it = self._iter() if self._iter is not None else None
        if it is None:
            it = self._deltas()
            self._iter = weakref.ref(it)
        return it

    async def start(self) -> None:
        """Subscribe to the stream subject, then queue the request (idempotent)."""
        if self._reader is not None:
            return
        c = self.client
        addressed = self._payload is None and not self.request.reply_subject
        mux = await c.reply_reader() if addressed else None
        if mux is not None:
            self.request = msgspec.structs.replace(
                self.request, reply_subject=c.subjects.reply_stream(c.client_id, self.request_id)
            )
        data = self._payload if self._payload is not None else encode(self.request)
        headers = inject_headers()
        size = len(data) + _headers_size({**headers, DEDUPE_HEADER: self.request_id})
        limit = c.payload_limit()
        if size > limit:
            raise PayloadTooLarge(
                f"request is {size} bytes; the limit is {limit} bytes (the NATS server's "
                "max_payload, or settings nats.max_payload); send a shorter prompt",
                request_id=self.request_id,
                param="prompt",
            )
        reader = StreamReader(
            c.nc,
            self.request.reply_subject or c.subjects.stream(self.request_id),
            self.first_token_timeout_s,
            self.idle_timeout_s,
            resend_subject=c.subjects.resend(self.request_id),
            mux=mux,
        )
        await reader.__aenter__()
        self._reader = reader
        self._started_at = time.perf_counter()
        try:
            await publish_acked(
                c.nc.jetstream(),
                c.subjects.requests,
                data,
                self.request_id,
                c.publish_ack_timeout_s,
                c.publish_attempts,
                headers=headers,
            )
        except MaxPayloadError as e:
            await self._close_reader()
            raise PayloadTooLarge(str(e), request_id=self.request_id, param="prompt") from None
        except (NoStreamResponseError, NoRespondersError) as e:
            await self._close_reader()
            raise FleetUnavailable(
                f"no JetStream stream takes {c.subjects.requests!r} (is the fleet up, with prefix "
                f"{c.subjects.prefix!r}?): {e!r}",
                request_id=self.request_id,
            ) from None
        except Exception as e:
            await self._close_reader()
            raise FleetUnavailable(
                f"could not queue the request: {e!r}", request_id=self.request_id
            ) from None

    async def aclose(self) -> None:
        """Stop reading; cancels the request on the fleet if it has not ended."""
        it = self._iter() if self._iter is not None else None
        if it is not None:
            await it.aclose()
        await self._end()

    async def _deltas(self) -> AsyncGenerator[TokenDelta, None]:
        await self.start()
        assert self._reader is not None
        messages = cast(AsyncGenerator[StreamMessage, None], self._reader.messages())
        try:
            async for msg in messages:
                if isinstance(msg, TokenDelta):
                    if self.ttft_s is None:
                        self.ttft_s = time.perf_counter() - self._started_at
                    yield msg
                elif isinstance(msg, Routed):
                    self.route = msg.route
                elif isinstance(msg, Migrated):
                    self.migrations += 1  # moved to another worker; the deltas go on
                    self.migration_reasons.append(msg.reason)
                elif isinstance(msg, Finished):
                    self.finished, self._done = msg, True
                elif isinstance(msg, ErrorMessage):
                    self._done = True
                    self.error = error_from_message(msg)
                    raise self.error
        except StreamGap as e:
            self.error = IncompleteStream(str(e), request_id=self.request_id)
            raise self.error from None
        except TimeoutError as e:
            if isinstance(e, StraitError):
                raise
            which = (
                "first message" if self.ttft_s is None and self.route is None else "next message"
            )
            limit = self.first_token_timeout_s if which == "first message" else self.idle_timeout_s
            self.error = Timeout(
                f"no {which} within {limit:g}s (first_token_timeout_s / idle_timeout_s)",
                request_id=self.request_id,
            )
            raise self.error from None
        finally:
            await messages.aclose()
            await self._end()

    async def _end(self) -> None:
        """Cancel if unfinished, unsubscribe, report usage: once, whoever gets here first."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._end_once())
        await asyncio.shield(self._ending)

    async def _end_once(self) -> None:
        if self._reader is None:
            return
        await self._close_reader()
        if not self._done:
            self._done = True
            try:
                await self.client.cancel(self.request_id, "client_closed")
            except Exception as e:  # connection gone: the worker finishes and nobody reads
                log.warning(
                    "cancel publish failed",
                    extra={"fields": {"request_id": self.request_id, "error": repr(e)}},
                )
        if self.client.report_usage and self._payload is None:
            await self._report_usage()

    async def _close_reader(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            await reader.__aexit__(None, None, None)

    async def _report_usage(self) -> None:
        f, err = self.finished, self.error
        status: Literal["ok", "error", "cancelled"] = "ok"
        if f is None:
            status = "error" if err is not None and err.code != "cancelled" else "cancelled"
        route = self.route
        ev = UsageEvent(
            request_id=self.request_id,
            api_key_id=self.request.api_key_id,
            pool=f.pool if f else route.pool if route else "",
            model=f.model if f else self.request.model,
            worker_id=f.worker_id if f else route.worker_id if route else "",
            route_code=route.code if route else "",
            route_factors=list(route.factors) if route else [],
            prompt_tokens=f.usage.prompt_tokens if f else 0,
            completion_tokens=f.usage.completion_tokens if f else 0,
            cached_tokens=f.usage.cached_tokens if f else 0,
            queued_s=f.timings.queued_s if f else 0.0,
            ttft_s=self.ttft_s,
            total_s=time.perf_counter() - self._started_at,
            status=status,
            error_code=err.code if err is not None else None,
            error=err.message if err is not None else None,
            created_at=self.request.created_at,
            source="nats-client",
        )
        c = self.client
        try:
            await publish_acked(
                c.nc.jetstream(),
                c.subjects.event("usage"),
                encode(ev),
                f"usage-{self.request_id}",
                c.publish_ack_timeout_s,
                c.publish_attempts,
            )
        except Exception as e:
            log.warning(
                "usage event publish failed",
                extra={"fields": {"request_id": self.request_id, "error": repr(e)}},
            )
