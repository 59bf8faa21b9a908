"""One NATS endpoint: the steps every service's subscription handler repeats, written once.

A service builds one :class:`Endpoint` per subject it serves and subscribes it
(``await endpoint.subscribe(nc, subject)``). Per message:

    decode as ``type`` (+ ``validate``) ─┬─ ProtocolError ─► ``reject(msg, error)``   "invalid"
                                         └─ ``handle(value, msg)`` ─► its answer, if any,
                                            to ``msg.reply``                           "ok"
    a handler that raises is logged with its traceback and counted                    "error"

around it, when ``span`` names one, a span parented on the message's trace context; and for
every message its outcome and handling time in ``strait_nats_messages_total`` /
``strait_nats_handle_seconds`` (label ``endpoint``), plus the service's own ``observe`` hook.

How a bad message is refused differs by subject, so ``reject`` is the endpoint's to choose:
:func:`dead_letters`, :func:`answers_or_dead_letters` (a typed refusal on the reply subject),
:func:`logs` or :func:`ignores`, or a service's own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Histogram

from libs.log import fields
from libs.protocol import ProtocolError, Subjects, decode, encode
from libs.telemetry import extract_context, tracer
from services.deadletter import dead_letter

log = logging.getLogger("strait.endpoint")

T = TypeVar("T")

# handle(value, msg): the decoded message, and the raw one (subject, headers) → the answer to
# publish on msg.reply, or None.
Handler = Callable[[T, Msg], Awaitable[msgspec.Struct | None]]
# reject(msg, error): what a message that failed decoding or validation gets.
Reject = Callable[[Msg, ProtocolError], Awaitable[None]]
# observe(outcome, seconds): a service's own metric of its endpoint, beside the shared one.
Observe = Callable[[str, float], None]

MESSAGES = Counter(
    "strait_nats_messages_total",
    "NATS messages handled, by endpoint and outcome (ok, invalid, no_reply, error)",
    ["endpoint", "outcome"],
)
HANDLE_SECONDS = Histogram(
    "strait_nats_handle_seconds",
    "Time from a NATS message's arrival at its handler to the handler's end",
    ["endpoint"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)


@dataclass
class Endpoint(Generic[T]):
    """``name``: what the metrics and logs call it (``<service>.<what>``, e.g.
    ``worker.assignment``). ``validate``: checks beyond the schema; a ProtocolError it raises is
    a rejection, any other exception a bug that still only rejects (``invalid_request``).
    ``needs_reply``: a request/reply endpoint; a message without a reply subject is rejected
    undecoded (``<what> without a reply subject``, ``what`` the name's last part), outcome
    ``no_reply``. ``span``: a span name (tracer ``strait.<service>``), or "" for none."""

    name: str
    type: type[T]
    handle: Handler[T]
    reject: Reject
    validate: Callable[[T], None] | None = None
    span: str = ""
    observe: Observe | None = None
    needs_reply: bool = False

    async def subscribe(self, nc: NATS, subject: str, **options: Any) -> Subscription:
        """Serve ``subject`` (``options``: nats-py's ``subscribe`` keywords)."""
        # nats-py takes coroutine functions only: the bound method, not the callable object.
        return await nc.subscribe(subject, cb=self.__call__, **options)

    async def __call__(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        outcome = "error"
        try:
            outcome = await self._serve(msg)
        except Exception:
            log.exception("handler failed", extra=fields(endpoint=self.name, subject=msg.subject))
        finally:
            seconds = time.perf_counter() - t0
            MESSAGES.labels(self.name, outcome).inc()
            HANDLE_SECONDS.labels(self.name).observe(seconds)
            if self.observe is not None:
                self.observe(outcome, seconds)

    async def _serve(self, msg: Msg) -> str:
        """The outcome of one message (an exception from the handler propagates)."""
        if self.needs_reply and not msg.reply:
            what = self.name.rsplit(".", 1)[-1]
            await self.reject(
                msg, ProtocolError("invalid_request", f"{what} without a reply subject")
            )
            return "no_reply"
        service = self.name.split(".", 1)[0]
        scope = (
            tracer(f"strait.{service}").start_as_current_span(
                self.span, context=extract_context(msg.headers)
            )
            if self.span
            else contextlib.nullcontext()
        )
        with scope:
            try:
                value = decode(msg.data, self.type)
                if self.validate is not None:
                    self._check(value)
            except ProtocolError as e:
                await self.reject(msg, e)
                return "invalid"
            answer = await self.handle(value, msg)
            if answer is not None and msg.reply:
                await msg.respond(encode(answer))
        return "ok"

    def _check(self, value: T) -> None:
        assert self.validate is not None
        try:
            self.validate(value)
        except ProtocolError:
            raise
        except Exception as e:  # a validation bug: refuse the message, never crash the handler
            log.exception("message could not be validated", extra=fields(endpoint=self.name))
            raise ProtocolError("invalid_request", repr(e)) from None


# ---------------------------------------------------------------- rejections


def dead_letters(nc: NATS, subjects: Subjects, service: str) -> Reject:
    """A message nobody waits an answer for: to the dead-letter subject (which logs it)."""

    async def reject(msg: Msg, e: ProtocolError) -> None:
        await dead_letter(nc, subjects, msg, str(e), service)

    return reject


def answers_or_dead_letters(
    nc: NATS,
    subjects: Subjects,
    service: str,
    refusal: Callable[[ProtocolError], msgspec.Struct],
    note: str = "",
) -> Reject:
    """A request: ``refusal(error)`` on its reply subject; without one, a dead letter whose
    error reads ``note`` + the error."""

    async def reject(msg: Msg, e: ProtocolError) -> None:
        if msg.reply:
            await nc.publish(msg.reply, encode(refusal(e)))
        else:
            await dead_letter(nc, subjects, msg, f"{note}{e}", service)

    return reject


def logs(logger: logging.Logger, message: str, level: int = logging.WARNING) -> Reject:
    """A broadcast whose sender does not wait for anything: one log line (``message``, with the
    subject and the error)."""

    async def reject(msg: Msg, e: ProtocolError) -> None:
        logger.log(level, message, extra=fields(subject=msg.subject, error=str(e)))

    return reject


async def ignores(msg: Msg, e: ProtocolError) -> None:
    """Drop it silently (the endpoint's metric still counts it ``invalid``)."""
