"""Reading one request's token stream: the request → many-replies side of core NATS.

Who reads: the gateway (through one :class:`StreamMux` of its own), the client library
(``libs.client``), the router's stream watch, and tests. How: open a :class:`StreamReader` on
the stream (or reply) subject *before* publishing the request, then iterate
:meth:`StreamReader.messages`: typed stream messages in ``seq`` order (from 1), duplicates
dropped, a missing ``seq`` asked for again from its writer (``ResendRequest``) and reported as a
:class:`StreamGap` when it never comes. The writer's side is ``libs.wire.stream_writer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.log import fields
from libs.protocol import (
    ErrorMessage,
    Finished,
    ResendRequest,
    StreamMessage,
    decode_stream,
    encode,
)

log = logging.getLogger("strait.nats")

# Seconds a reader holds later stream messages waiting for a missing one before it reports the
# gap (core NATS does not redeliver; a reordering between publishers settles in milliseconds),
# and after how long of a gap it asks the writer to resend.
STREAM_GAP_TIMEOUT_S = 5.0
RESEND_AFTER_S = 0.5
# A loop may run a timer up to its clock resolution early (asyncio) or round to whole ms
# (uvloop); a reader's wait counts as over within this much of its end.
TIMER_SLACK_S = 0.002


class StreamGap(Exception):
    """A stream message never arrived (``expected`` seq) before the stream's end."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"stream gap: expected seq {expected}, got {got}")
        self.expected = expected
        self.got = got


@dataclass
class StreamStats:
    duplicates: int = 0
    reordered: int = 0
    resends: int = 0  # ResendRequests this reader published


class StreamReader:
    """Reads one request's stream subject. Use as an async context manager *around* publishing.

    ``messages()`` yields typed stream messages in ``seq`` order (starting at 1); duplicates are
    dropped, out-of-order messages are held until the gap fills; it ends after ``Finished`` or
    ``ErrorMessage``. Raises ``TimeoutError`` on silence and ``StreamGap`` when an earlier seq
    is still missing ``gap_timeout_s`` after a later one arrived (a message lost, e.g. published
    while this connection was re-subscribing after a reconnect), or when the terminal message
    arrives and the gap does not fill within that time. After the connection reconnected, a
    started stream silent for ``gap_timeout_s`` is such a gap too (its remaining messages may
    all have been lost), instead of a wait for ``idle_timeout_s``.
    """

    def __init__(
        self,
        nc: NATS,
        subject: str,
        first_timeout_s: float,
        idle_timeout_s: float,
        max_pending: int = 4096,
        gap_timeout_s: float = STREAM_GAP_TIMEOUT_S,
        resend_subject: str = "",
        mux: StreamMux | None = None,
    ) -> None:
        """``mux``: read ``subject`` through that shared subscription (it must cover
        ``subject``) instead of subscribing to it alone."""
        self._nc = nc
        self.subject = subject
        self._first_timeout = first_timeout_s
        self._idle_timeout = idle_timeout_s
        self._gap_timeout = gap_timeout_s
        self._reconnects = 0
        # Where to ask the stream's writer for missing messages ("" = never ask).
        self._resend_subject = resend_subject
        # (payload, the connection's reconnect count when it arrived), at most max_pending.
        # A deque and one future per wait, not asyncio.Queue + wait_for: a gateway pays this
        # once per streamed token (wait_for costs a task per call).
        self._buf: deque[tuple[bytes, int]] = deque()
        self._max_pending = max_pending
        # Set True by a message, False by the timer. The timer is lazy: one armed TimerHandle
        # per reader, kept while waits end before it (a token stream moves its deadline on
        # every message); when it fires early it re-arms for ``_wake_at``. A timer per wait
        # (``asyncio.timeout``) was ~13% of a busy gateway's CPU.
        self._waiter: asyncio.Future[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at = 0.0  # loop time at which the current wait gives up its slice
        self._mux = mux
        self._sub: Subscription | None = None
        self.stats = StreamStats()
        self.overflowed = False

    def deliver(self, data: bytes) -> None:
        """One message of the stream, as it arrives (the subscription's or the mux's callback)."""
        if len(self._buf) >= self._max_pending:
            # A dropped message is a gap: report it once and fail the read, never truncate.
            if not self.overflowed:
                log.warning("stream reader queue full", extra=fields(subject=self.subject))
            self.overflowed = True
        else:
            self._buf.append((data, self._nc.stats["reconnects"]))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    async def __aenter__(self) -> StreamReader:
        self._reconnects = self._nc.stats["reconnects"]
        if self._mux is not None:
            self._mux.add(self)  # the mux's subscription is on the server already
            return self

        async def on_msg(msg: Msg) -> None:
            self.deliver(msg.data)

        self._sub = await self._nc.subscribe(self.subject, cb=on_msg)
        # Make sure the server knows the subscription before anyone publishes to it.
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()  # else the loop keeps this reader until it fires
            self._timer = None
        if self._mux is not None:
            self._mux.remove(self)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass
            self._sub = None

    @property
    def pending(self) -> int:
        """Messages received and not yet taken by :meth:`messages`."""
        return len(self._buf)

    def _reconnected(self) -> bool:
        """The connection reconnected since this reader subscribed: messages published while
        it re-subscribed are lost for good (core NATS keeps nothing)."""
        return self._nc.stats["reconnects"] != self._reconnects

    async def _wait(
        self, timeout: float, expected: int, held: dict[int, StreamMessage]
    ) -> tuple[bytes, int]:
        """The next message within ``timeout``. A missing ``seq`` (``held`` non-empty), or a
        started stream silent after the connection reconnected (its remaining messages may all
        have been lost), is a gap: after ``RESEND_AFTER_S`` of it the writer is asked to send
        again from ``expected`` (once per wait), and after ``gap_timeout_s`` it is a
        StreamGap. Waits in slices so a reconnect during a long wait is noticed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        gap_since = 0.0
        asked = False
        while True:
            if self._buf:
                return self._buf.popleft()
            now = loop.time()
            gap = bool(held) or (expected > 1 and self._reconnected())
            slice_s = RESEND_AFTER_S if gap else self._gap_timeout
            self._waiter = waiter = loop.create_future()
            self._arm(loop, now + max(min(deadline - now, slice_s), 0.0))
            if await waiter:
                continue
            now = loop.time()
            if gap:
                gap_since = gap_since or now - RESEND_AFTER_S
                if now - gap_since >= self._gap_timeout:
                    got = min(held) if held else -1
                    raise StreamGap(expected, got)
                if not asked and self._resend_subject:
                    asked = True
                    self.stats.resends += 1
                    await self._ask_resend(expected)
                continue
            if now >= deadline:
                raise TimeoutError(f"no stream message on {self.subject} for {timeout:g} s")

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        """Wake the current waiter with False at loop time ``when`` unless a message comes
        first. A timer already due no later than ``when`` is kept (it re-arms on firing)."""
        self._wake_at = when
        t = self._timer
        if t is None or t.when() > when:
            if t is not None:
                t.cancel()
            self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # nobody waits: the next wait arms again
        if loop.time() >= self._wake_at - TIMER_SLACK_S:
            w.set_result(False)
        else:
            self._timer = loop.call_at(self._wake_at, self._on_timer, loop)

    async def _ask_resend(self, from_seq: int) -> None:
        rid = self._resend_subject.rsplit(".", 1)[-1]  # resend.<request_id>
        try:
            await self._nc.publish(
                self._resend_subject, encode(ResendRequest(request_id=rid, from_seq=from_seq))
            )
        except Exception as e:  # reconnecting again: the gap timeout still ends the wait
            log.warning("resend request failed", extra=fields(subject=self.subject, error=repr(e)))

    async def messages(self) -> AsyncIterator[StreamMessage]:
        expected = 1
        held: dict[int, StreamMessage] = {}
        timeout = self._first_timeout
        while True:
            if self.overflowed:
                raise StreamGap(expected, -1)
            # A message already queued is taken at once.
            if self._buf:
                data, era = self._buf.popleft()
            else:
                data, era = await self._wait(timeout, expected, held)
            if era != self._reconnects:
                # The stream flows again after a reconnect: a loss now shows as a seq gap.
                self._reconnects = era
            timeout = self._idle_timeout
            try:
                msg = decode_stream(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("bad stream message", extra=fields(subject=self.subject, error=str(e)))
                continue
            if msg.seq < expected or msg.seq in held:
                self.stats.duplicates += 1
                continue
            if msg.seq > expected:
                # Held until the gap fills (``_wait`` asks for a resend, then gives up).
                self.stats.reordered += 1
                held[msg.seq] = msg
                continue
            held[msg.seq] = msg
            while expected in held:
                ready = held.pop(expected)
                expected += 1
                yield ready
                if isinstance(ready, Finished | ErrorMessage):
                    return


class StreamMux:
    """One subscription (``wildcard``) that feeds many :class:`StreamReader`: the gateway and
    the fleet account's ``StraitClient`` read every request they submit through one
    (``Subjects.reply_streams``). Created and started by
    the owner of the connection; readers add and remove themselves. A message for a subject
    no reader holds (a stream's stragglers after its reader left) is dropped."""

    def __init__(self, nc: NATS, wildcard: str) -> None:
        self._nc = nc
        self.wildcard = wildcard
        self._readers: dict[str, StreamReader] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        async def on_msg(msg: Msg) -> None:
            reader = self._readers.get(msg.subject)
            if reader is not None:
                reader.deliver(msg.data)

        self._sub = await self._nc.subscribe(self.wildcard, cb=on_msg)
        await self._nc.flush()

    def add(self, reader: StreamReader) -> None:
        self._readers[reader.subject] = reader

    def remove(self, reader: StreamReader) -> None:
        if self._readers.get(reader.subject) is reader:
            del self._readers[reader.subject]

    async def stop(self) -> None:
        """Unsubscribe (for a connection that outlives the mux; closing it does as much)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection is already closed
                await self._sub.unsubscribe()
            self._sub = None

    def __len__(self) -> int:
        return len(self._readers)
