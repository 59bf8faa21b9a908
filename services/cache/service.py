"""The cache service's NATS side: three handlers over one BlockStore, and an event publisher.

    <p>.cache.lookup  CacheLookup ─► store.lookup ─► reply CacheLookupReply
    <p>.cache.fetch   CacheFetch  ─► store.get ─► reply inbox: CacheFetchReply, chunk 0..n-1
    <p>.cache.store   CacheStore, chunk 0..n-1 ─► reassemble ─► kv_transfer.decode ─► store.put
    store changes ─► CacheEvent queue ─► one publisher task ─► JetStream <p>.cache.events

Each subscription's handler runs one message at a time (nats-py), so a store's chunks arrive in
order and the store is only touched from this event loop. Lookup and fetch are
``services.endpoint.Endpoint``s (span, decoding, metrics); a store's head and chunks share one
subject and are told apart by header, by hand. Bad input never raises out of a handler: a
request with a reply subject gets an ``ErrorMessage``, anything else is dead-lettered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from libs.engine import kv_transfer
from libs.engine.kv_transfer import KvBlocks
from libs.log import fields
from libs.protocol import (
    CHUNK_HEADER,
    TRANSFER_HEADER,
    CacheEvent,
    CacheFetch,
    CacheFetchReply,
    CacheLookup,
    CacheLookupReply,
    CacheMissReason,
    CacheStore,
    ErrorMessage,
    ProtocolError,
    Subjects,
    decode,
    encode,
)
from libs.settings import Settings
from libs.wire.kv_cache_client import FetchError, chunk_limit, join_chunks
from libs.wire.nats_util import cache_events_stream_config, ensure_stream, publish_chunks
from services.cache import metrics
from services.cache.store import BlockStore, Changes
from services.deadletter import dead_letter
from services.endpoint import Endpoint

log = logging.getLogger("strait.cache")

SERVICE = "cache"


@dataclass
class _Assembly:
    """One store transfer being reassembled: its head and the chunks in so far."""

    head: CacheStore
    started: float  # time.monotonic()
    chunks: dict[int, bytes] = field(default_factory=dict)
    received_bytes: int = 0


class CacheService:
    def __init__(self, nc: NATS, js: JetStreamContext, settings: Settings) -> None:
        self._nc = nc
        self._js = js
        self._settings = settings
        self._cfg = settings.cache
        self.subjects = Subjects.of(settings.nats)
        self.cache_id = self._cfg.cache_id or f"cache-{socket.gethostname()}-{os.getpid()}"
        self.store = BlockStore(self._cfg)
        self._events: asyncio.Queue[CacheEvent] = asyncio.Queue(maxsize=self._cfg.event_queue)
        self._assemblies: dict[str, _Assembly] = {}
        self._pending_store_bytes = 0  # sum of total_bytes of self._assemblies
        self._subs: list[Subscription] = []
        self._publisher: asyncio.Task[None] | None = None

    @property
    def nc(self) -> NATS:
        """The service's NATS connection (tests open clients on it)."""
        return self._nc

    # ------------------------------------------------------------ lifetime

    async def start(self) -> None:
        await ensure_stream(self._js, cache_events_stream_config(self._settings.nats))
        self._publisher = asyncio.create_task(self._publish_events())
        # The store starts empty (the disk tier too): readers replaying the stream drop
        # everything announced before this event.
        await self._events.put(CacheEvent(cache_id=self.cache_id, cleared=True))
        lookup = Endpoint(
            "cache.lookup",
            CacheLookup,
            self.on_lookup,
            self._reject,
            span="cache.lookup",
            observe=self._observer("lookup"),
        )
        fetch = Endpoint(
            "cache.fetch",
            CacheFetch,
            self.on_fetch,
            self._reject,
            span="cache.fetch",
            observe=self._observer("fetch"),
            needs_reply=True,
        )
        self._subs += [
            await lookup.subscribe(self._nc, self.subjects.cache_lookup),
            await fetch.subscribe(self._nc, self.subjects.cache_fetch),
            # A store's head and its raw chunks share one subject: hand-written (on_store).
            await self._nc.subscribe(self.subjects.cache_store, cb=self.on_store),
        ]
        await self._nc.flush()

    async def close(self, drain_timeout_s: float) -> None:
        """Stop taking requests, publish the events still queued, stop the publisher."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                pass
        self._subs.clear()
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._events.join()
        except TimeoutError:
            log.warning("cache events not all published", extra=fields(left=self._events.qsize()))
        if self._publisher is not None:
            self._publisher.cancel()
            try:
                await self._publisher
            except asyncio.CancelledError:
                pass

    # ------------------------------------------------------------ lookup

    async def on_lookup(self, req: CacheLookup, msg: Msg) -> CacheLookupReply:
        outcome = self.store.lookup(req.model_id, req.block_hashes, req.salt)
        log.info(
            "cache lookup",
            extra=fields(
                model=req.model_id,
                blocks=len(req.block_hashes),
                hit_blocks=outcome.num_hit_blocks,
                miss_reason=outcome.miss_reason,
            ),
        )
        return CacheLookupReply(
            num_hit_blocks=outcome.num_hit_blocks, miss_reason=outcome.miss_reason
        )

    # ------------------------------------------------------------ fetch

    async def on_fetch(self, req: CacheFetch, msg: Msg) -> None:
        assert msg.reply  # the endpoint rejects a fetch without one
        kv, outcome, changes = self.store.get(req.model_id, req.block_hashes, req.salt)
        await self._emit(changes)
        sent = await self._send_fetch(msg.reply, kv, outcome.miss_reason)
        log.info(
            "cache fetch",
            extra=fields(
                model=req.model_id,
                blocks=len(req.block_hashes),
                hit_blocks=outcome.num_hit_blocks,
                miss_reason=outcome.miss_reason,
                bytes=sent,
            ),
        )

    async def _send_fetch(
        self, inbox: str, kv: KvBlocks | None, miss_reason: CacheMissReason | None
    ) -> int:
        """Answer one fetch on ``inbox``: head, then the chunks. Returns the payload bytes."""
        if kv is None:
            head = CacheFetchReply(num_blocks=0, miss_reason=miss_reason)
            await self._nc.publish(inbox, encode(head))
            return 0
        payload = kv_transfer.encode(kv)
        pieces = kv_transfer.split(payload, chunk_limit(self._nc, self._settings))
        head = CacheFetchReply(
            num_blocks=len(kv.header.block_hashes),
            total_bytes=len(payload),
            num_chunks=len(pieces),
            miss_reason=miss_reason,
        )
        await self._nc.publish(inbox, encode(head))
        await publish_chunks(self._nc, inbox, pieces, {})
        metrics.TRANSFER_BYTES.labels("fetch").inc(len(payload))
        return len(payload)

    # ------------------------------------------------------------ store

    async def on_store(self, msg: Msg) -> None:
        headers = msg.headers or {}
        transfer_id = headers.get(TRANSFER_HEADER)
        if transfer_id is None:
            await self._on_store_head(msg)
        else:
            await self._on_store_chunk(msg, transfer_id, headers.get(CHUNK_HEADER, ""))

    async def _on_store_head(self, msg: Msg) -> None:
        self._expire_assemblies()
        try:
            head = decode(msg.data, CacheStore)
        except ProtocolError as e:
            metrics.REQUESTS.labels("store", "invalid").inc()
            await self._reject(msg, e)
            return
        if head.transfer_id in self._assemblies:
            return  # a duplicate head: the first one's chunks are already coming
        if self._pending_store_bytes + head.total_bytes > self._cfg.max_pending_store_bytes:
            log.warning(
                "cache store refused",
                extra=fields(
                    transfer_id=head.transfer_id,
                    bytes=head.total_bytes,
                    pending_bytes=self._pending_store_bytes,
                    limit="cache.max_pending_store_bytes",
                ),
            )
            metrics.REQUESTS.labels("store", "refused").inc()
            return
        self._assemblies[head.transfer_id] = _Assembly(head, time.monotonic())
        self._pending_store_bytes += head.total_bytes

    async def _on_store_chunk(self, msg: Msg, transfer_id: str, index_text: str) -> None:
        asm = self._assemblies.get(transfer_id)
        if asm is None:
            # Its head was refused, expired or never came: nothing to add it to.
            metrics.REQUESTS.labels("store", "orphan_chunk").inc()
            return
        try:
            index = int(index_text)
        except ValueError:
            index = -1
        size = asm.received_bytes + len(msg.data)
        if (
            not 0 <= index < asm.head.num_chunks
            or index in asm.chunks
            or size > asm.head.total_bytes
        ):
            self._drop_assembly(transfer_id)
            await self._bad_store(msg, f"chunk {index_text!r} does not fit transfer {transfer_id}")
            return
        asm.chunks[index] = msg.data
        asm.received_bytes = size
        if len(asm.chunks) == asm.head.num_chunks:
            self._drop_assembly(transfer_id)
            await self._complete_store(msg, asm)

    async def _complete_store(self, msg: Msg, asm: _Assembly) -> None:
        t0 = time.perf_counter()
        try:
            payload = join_chunks(asm.chunks, asm.head.num_chunks, asm.head.total_bytes)
            kv = kv_transfer.decode(payload)
            _check_blocks(kv)
        except (FetchError, ValueError) as e:
            await self._bad_store(msg, f"transfer {asm.head.transfer_id}: {e}")
            return
        changes = self.store.put(kv, asm.head.salt)
        await self._emit(changes)
        metrics.TRANSFER_BYTES.labels("store").inc(len(payload))
        self._done("store", "ok", t0)
        log.info(
            "cache store",
            extra=fields(
                model=kv.header.model_id,
                blocks=len(kv.header.block_hashes),
                stored_blocks=len(changes.stored),
                evicted_blocks=len(changes.evicted),
                bytes=len(payload),
            ),
        )

    def _drop_assembly(self, transfer_id: str) -> None:
        asm = self._assemblies.pop(transfer_id, None)
        if asm is not None:
            self._pending_store_bytes -= asm.head.total_bytes

    def _expire_assemblies(self) -> None:
        """Drop stores whose chunks did not all arrive within cache.store_timeout_s."""
        deadline = time.monotonic() - self._cfg.store_timeout_s
        for transfer_id, asm in list(self._assemblies.items()):
            if asm.started < deadline:
                log.warning(
                    "cache store incomplete; dropped",
                    extra=fields(
                        transfer_id=transfer_id,
                        chunks=len(asm.chunks),
                        num_chunks=asm.head.num_chunks,
                        limit="cache.store_timeout_s",
                    ),
                )
                self._drop_assembly(transfer_id)
                metrics.REQUESTS.labels("store", "expired").inc()

    async def _bad_store(self, msg: Msg, error: str) -> None:
        metrics.REQUESTS.labels("store", "invalid").inc()
        await dead_letter(self._nc, self.subjects, msg, error, SERVICE)

    # ------------------------------------------------------------ shared

    async def _reject(self, msg: Msg, e: ProtocolError) -> None:
        """A request that failed validation: a typed error to its reply subject, else a dead
        letter. The service carries on."""
        if msg.reply:
            op = msg.subject.rsplit(".", 1)[-1]
            log.info("cache bad request", extra=fields(op=op, code=e.code, error=str(e)[:200]))
            err = ErrorMessage(seq=1, request_id=e.request_id, code=e.code, message=str(e))
            await self._nc.publish(msg.reply, encode(err))
        else:
            await dead_letter(self._nc, self.subjects, msg, str(e), SERVICE)

    @staticmethod
    def _observer(op: str) -> Callable[[str, float], None]:
        """The cache's own metrics of an endpoint's outcome (``no_reply``: a dead letter)."""

        def observe(outcome: str, seconds: float) -> None:
            metrics.REQUESTS.labels(op, "dead_letter" if outcome == "no_reply" else outcome).inc()
            if outcome == "ok":
                metrics.REQUEST_SECONDS.labels(op).observe(seconds)

        return observe

    def _done(self, op: str, result: str, t0: float) -> None:
        metrics.REQUESTS.labels(op, result).inc()
        metrics.REQUEST_SECONDS.labels(op).observe(time.perf_counter() - t0)

    async def _emit(self, changes: Changes) -> None:
        """Queue one CacheEvent per (model, salt) that changed; waits when the queue is full."""
        if not changes:
            return
        groups: dict[tuple[str, str], CacheEvent] = defaultdict(lambda: CacheEvent(cache_id=""))
        for key in changes.stored:
            groups[(key.model_id, key.salt)].stored.append(key.block_hash)
        for key in changes.evicted:
            groups[(key.model_id, key.salt)].evicted.append(key.block_hash)
        for (model_id, salt), ev in groups.items():
            ev.cache_id, ev.model_id, ev.salt = self.cache_id, model_id, salt
            await self._events.put(ev)

    async def _publish_events(self) -> None:
        """The one publisher: events reach the stream in the order the store changed."""
        subject = self.subjects.cache_events
        while True:
            ev = await self._events.get()
            try:
                await self._js.publish(subject, encode(ev))
                metrics.EVENTS.inc()
            except Exception as e:
                metrics.EVENT_ERRORS.inc()
                log.warning("cache event not published", extra=fields(error=repr(e)))
            finally:
                self._events.task_done()


def _check_blocks(kv: KvBlocks) -> None:
    """What store.put relies on beyond kv_transfer.decode's own checks. Raises ValueError."""
    h = kv.header
    if not h.model_id:
        raise ValueError("KV header has an empty model_id")
    if len(h.shape) != 6:
        raise ValueError(f"KV shape {h.shape} is not [layers, 2, kv_heads, blocks, block, dim]")
    if h.shape[3] != len(h.block_hashes) or h.shape[4] != h.block_size:
        raise ValueError(f"KV shape {h.shape} does not match {len(h.block_hashes)} hashes")
