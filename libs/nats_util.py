"""NATS helpers shared by every service and the client library.

- ``connect``: a connection that reconnects forever and logs each state change.
- ``provision``: idempotent JetStream streams and consumers (create, or update to match).
- ``publish_msg`` / ``request_msg``: typed messages with W3C trace context in headers.
- ``StreamReader``: the request → many-replies pattern: subscribe to a reply subject *before*
  publishing, then iterate the typed stream messages in ``seq`` order, dropping duplicates and
  reporting gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError

from libs.log import fields
from libs.protocol import (
    CHUNK_HEADER,
    ErrorMessage,
    Finished,
    ResendRequest,
    StreamMessage,
    Subjects,
    decode_stream,
    encode,
)
from libs.settings import NatsSettings
from libs.telemetry import inject_headers

log = logging.getLogger("strait.nats")


def server_urls(url: str) -> list[str]:
    """``nats.url`` may list a cluster's servers, comma-separated: the client connects to one
    and fails over to the others (and to those the cluster announces)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def tls_context(ca_file: str, cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """A client TLS context that verifies the server against ``ca_file`` (and presents a
    client certificate when ``cert_file`` is given)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file or None)
    return ctx


def auth_options(
    nkey_seed_file: str = "", tls_ca_file: str = "", tls_cert_file: str = "", tls_key_file: str = ""
) -> dict[str, Any]:
    """nats-py ``connect`` keyword arguments for an nkey seed file and TLS (none when empty)."""
    opts: dict[str, Any] = {}
    if nkey_seed_file:
        opts["nkeys_seed"] = nkey_seed_file
    if tls_ca_file:
        opts["tls"] = tls_context(tls_ca_file, tls_cert_file, tls_key_file)
    return opts


async def connect(settings: NatsSettings, name: str) -> NATS:
    """Connect to ``settings.url`` with its credentials (nkey seed, TLS); retries the first
    connect a few times, then forever on loss."""

    async def on_disconnect() -> None:
        log.warning("nats disconnected", extra=fields(client=name))

    async def on_reconnect() -> None:
        log.info("nats reconnected", extra=fields(client=name))

    async def on_error(e: Exception) -> None:
        log.warning("nats error", extra=fields(client=name, error=repr(e)))

    async def on_closed() -> None:
        log.info("nats connection closed", extra=fields(client=name))

    return await nats.connect(
        servers=server_urls(settings.url),
        name=name,
        connect_timeout=settings.connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        closed_cb=on_closed,
        **auth_options(
            settings.nkey_seed_file,
            settings.tls_ca_file,
            settings.tls_cert_file,
            settings.tls_key_file,
        ),
    )


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create ``config.name`` or update it in place; safe to call from every replica."""
    try:
        await js.add_stream(config=config)
    except BadRequestError:
        await js.update_stream(config=config)


async def ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> None:
    try:
        await js.add_consumer(stream, config=config)
    except BadRequestError:
        # Exists with another config: delete and re-create only if the filter changed.
        assert config.durable_name is not None
        try:
            info = await js.consumer_info(stream, config.durable_name)
        except NotFoundError:
            raise
        if (info.config.filter_subject, info.config.filter_subjects) != (
            config.filter_subject,
            config.filter_subjects,
        ):
            await js.delete_consumer(stream, config.durable_name)
            await js.add_consumer(stream, config=config)


def batch_stream_config(settings: NatsSettings, window_s: float, dedupe_s: float) -> StreamConfig:
    """The Batch API's lines (``BatchLine`` on ``batch.<batch_id>``): a work queue, each line
    stored once per ``Nats-Msg-Id`` (``<batch_id>:<index>``) within ``dedupe_s``, kept at most
    ``window_s`` (the batch's completion window)."""
    return StreamConfig(
        name=settings.batch_stream,
        subjects=[Subjects(settings.subject_prefix).batch_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=window_s,
        duplicate_window=dedupe_s,
        max_msg_size=settings.max_payload,
        num_replicas=settings.stream_replicas,
    )


def stream_configs(settings: NatsSettings) -> list[StreamConfig]:
    """The JetStream streams Strait uses, with their limits."""
    subjects = Subjects(settings.subject_prefix)
    return [
        # The fleet's own requests; each team's have a stream of their own
        # (team_stream_config), which routers read beside this one.
        _requests_queue(settings, settings.requests_stream, subjects.requests),
        StreamConfig(
            name=settings.events_stream,
            subjects=[subjects.events_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=settings.events_max_age_s,
            num_replicas=settings.stream_replicas,
        ),
        cache_events_stream_config(settings),
    ]


def cache_events_stream_config(settings: NatsSettings) -> StreamConfig:
    """The prefix-cache service's stored/evicted events: kept (not consumed) so that any
    number of readers can replay them from the start to rebuild the set of held blocks."""
    return StreamConfig(
        name=settings.cache_events_stream,
        subjects=[Subjects(settings.subject_prefix).cache_events],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.cache_events_max_age_s,
        num_replicas=settings.stream_replicas,
    )


async def provision(js: JetStreamContext, settings: NatsSettings) -> None:
    for cfg in stream_configs(settings):
        await ensure_stream(js, cfg)


def team_stream_name(settings: NatsSettings, team: str) -> str:
    return f"{settings.requests_stream}_{team}"


def team_stream_config(settings: NatsSettings, team: str) -> StreamConfig:
    """Team ``team``'s requests queue (``requests.<team>``, where its account's import writes).
    One stream a team because JetStream de-duplicates ``Nats-Msg-Id`` per stream: a team's
    ids can never suppress another's. (Sourcing the teams' streams into one would not do: a
    stream de-duplicates what it sources too.) Routers consume each with their durable."""
    subject = Subjects(settings.subject_prefix).team_requests(team)
    return _requests_queue(settings, team_stream_name(settings, team), subject)


def _requests_queue(settings: NatsSettings, name: str, subject: str) -> StreamConfig:
    """A work queue of requests on ``subject``, each kept once per ``Nats-Msg-Id``."""
    return StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_age=settings.request_max_age_s,
        duplicate_window=settings.request_dedupe_window_s,
        max_msg_size=settings.max_payload,
        num_replicas=settings.stream_replicas,
    )


async def ensure_team_streams(
    js: JetStreamContext, settings: NatsSettings, teams: list[str]
) -> None:
    """Each team's requests stream; idempotent. ``strait teams add`` calls it before the
    server lets the team in (its first request is stored at once), routers at start and when
    the teams file changes."""
    for team in teams:
        await ensure_stream(js, team_stream_config(settings, team))


def work_queue_consumer(
    durable: str, filter_subjects: list[str], ack_wait_s: float
) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        filter_subjects=filter_subjects,
        deliver_policy=DeliverPolicy.ALL,
    )


async def publish_msg(
    nc: NATS,
    subject: str,
    msg: msgspec.Struct,
    reply: str = "",
    headers: dict[str, str] | None = None,
) -> None:
    await nc.publish(subject, encode(msg), reply=reply, headers=inject_headers(headers))


# The JetStream header that makes a stream keep one copy of a message published more than once.
DEDUPE_HEADER = "Nats-Msg-Id"
# Seconds between publish attempts that found no stream (a restarted server recovering it).
PUBLISH_RETRY_PAUSE_S = 0.5


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    msg_id: str,
    timeout_s: float,
    attempts: int,
    headers: dict[str, str] | None = None,
) -> None:
    """JetStream publish of one message under ``msg_id`` (``Nats-Msg-Id``: the stream stores
    it once however often it is sent), again on a missing ack (late, or lost while the
    server restarted) and on no responders (a restarted server's stream not back yet), at most
    ``attempts`` times. The gateway (requests, usage), the workers (usage) and the client
    library (requests, usage) publish this way; the last error is raised."""
    hdrs = {**(headers or {}), DEDUPE_HEADER: msg_id}
    for attempt in range(1, attempts + 1):
        try:
            await js.publish(subject, data, headers=hdrs, timeout=timeout_s)
            return
        except (TimeoutError, NoStreamResponseError) as e:
            if attempt == attempts:
                raise
            if isinstance(e, NoStreamResponseError):  # a missing ack has waited already
                await asyncio.sleep(PUBLISH_RETRY_PAUSE_S)


async def request_msg(nc: NATS, subject: str, msg: msgspec.Struct, timeout: float) -> Msg:
    return await nc.request(subject, encode(msg), timeout=timeout, headers=inject_headers())


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


class StreamTaken(Exception):
    """The writer's worker no longer owns its streams (see ``StreamWriter``'s ``owner``)."""


class StreamWriter:
    """Publishes one request's stream messages with consecutive ``seq`` numbers.

    ``owner`` (optional) is asked before every publish; when it answers False, ``send`` raises
    :class:`StreamTaken` and publishes nothing: a worker that the router presumed lost (its
    beats stopped long enough) must not write into a stream another worker now continues."""

    def __init__(
        self,
        nc: NATS,
        subject: str,
        request_id: str,
        first_seq: int = 1,
        owner: Callable[[], bool] | None = None,
        keep: int = 0,
        key: str = "",
    ) -> None:
        self._nc = nc
        self.subject = subject
        self.request_id = request_id  # as the stream's messages name it
        self.key = key or request_id  # GenerateRequest.key: how the worker's maps know it
        self._seq = first_seq - 1  # a decode worker continues a stream a prefill worker began
        self._owner = owner
        # The last ``keep`` messages sent, as (seq, bytes), for resend().
        self.sent: deque[tuple[int, bytes]] = deque(maxlen=keep)  # keep = 0: nothing kept

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def peek_seq(self) -> int:
        """The seq the next message would get (handed to whoever continues the stream)."""
        return self._seq + 1

    async def send(self, msg: msgspec.Struct) -> None:
        if self._owner is not None and not self._owner():
            raise StreamTaken(self.request_id)
        data = encode(msg)
        await self._nc.publish(self.subject, data)
        self.sent.append((getattr(msg, "seq", 0), data))

    async def resend(self, from_seq: int) -> int:
        """Publish again the kept messages from ``from_seq`` on; returns how many."""
        if self._owner is not None and not self._owner():
            return 0
        again = [data for seq, data in self.sent if seq >= from_seq]
        for data in again:
            await self._nc.publish(self.subject, data)
        return len(again)


async def publish_chunks(
    nc: NATS, subject: str, pieces: list[bytes], headers: dict[str, str]
) -> None:
    """Publish ``pieces`` in order, each with ``headers`` plus its index in CHUNK_HEADER."""
    for i, piece in enumerate(pieces):
        await nc.publish(subject, piece, headers={**headers, CHUNK_HEADER: str(i)})
