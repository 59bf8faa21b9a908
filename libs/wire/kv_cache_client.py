"""Client of the prefix-cache service (services/cache, docs/cache.md), for prefill workers.

    cache = CacheClient(nc, settings)
    result = await cache.lookup(model_id, block_hashes)  # LookupResult: leading hits, miss reason
    kv = await cache.fetch(model_id, block_hashes)       # KvBlocks of the leading hits, or None
    await cache.store(kv)                                # fire-and-forget: no reply awaited

A cache is optional: no method raises. ``lookup`` reports a failure in ``LookupResult.error``;
``fetch`` returns None on any failure or timeout (``cache.fetch_timeout_s``); ``store`` logs and
drops. With ``cache.enabled = false`` every method answers at once without touching NATS.

The chunk framing (shared with the service) is spelled out in libs/protocol/cache.py: a typed JSON head, then raw chunks of a ``kv_transfer.encode`` payload, each
with its index in the ``Strait-Chunk`` header.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from libs.engine import kv_transfer
from libs.engine.kv_transfer import KvBlocks
from libs.log import fields
from libs.protocol import (
    CHUNK_HEADER,
    CHUNK_HEADROOM_BYTES,
    TRANSFER_HEADER,
    CacheFetch,
    CacheFetchAnswer,
    CacheFetchReply,
    CacheLookup,
    CacheLookupAnswer,
    CacheMissReason,
    CacheStore,
    ErrorMessage,
    Subjects,
    encode,
)
from libs.settings import Settings
from libs.telemetry import inject_headers
from libs.wire.nats_util import publish_chunks

log = logging.getLogger("strait.cache.client")


@dataclass(frozen=True, slots=True)
class LookupResult:
    num_hit_blocks: int  # leading blocks of the prefix the cache holds
    miss_reason: CacheMissReason | None = None  # why the next block missed; None: all held
    error: str = ""  # non-empty: the cache did not answer ("disabled", a timeout, an error)


class FetchError(Exception):
    """A fetch answer that cannot be used (error reply, missing or extra chunks, bad bytes)."""


def chunk_limit(nc: NATS, settings: Settings, override: int | None = None) -> int:
    """Bytes of KV payload per NATS message: fits the configured and the server's max_payload
    with room for the chunk's headers; ``override`` (default ``cache.chunk_bytes``) lowers it
    when set. Also used by the KV handoff (with ``handoff.chunk_bytes``)."""
    limit = min(settings.nats.max_payload, nc.max_payload) - CHUNK_HEADROOM_BYTES
    lower = settings.cache.chunk_bytes if override is None else override
    if lower > 0:
        limit = min(limit, lower)
    if limit < 1:
        raise ValueError(
            f"max_payload {nc.max_payload} leaves no room for chunks "
            f"(CHUNK_HEADROOM_BYTES={CHUNK_HEADROOM_BYTES})"
        )
    return limit


def join_chunks(chunks: dict[int, bytes], num_chunks: int, total_bytes: int) -> bytes:
    """The payload of a complete transfer; raises FetchError when a chunk is missing/extra."""
    if sorted(chunks) != list(range(num_chunks)):
        raise FetchError(f"chunks {sorted(chunks)[:8]}... are not 0..{num_chunks - 1}")
    payload = b"".join(chunks[i] for i in range(num_chunks))
    if len(payload) != total_bytes:
        raise FetchError(f"{len(payload)} bytes received, head says {total_bytes}")
    return payload


class CacheClient:
    def __init__(self, nc: NATS, settings: Settings) -> None:
        self._nc = nc
        self._settings = settings
        self._cfg = settings.cache
        self.subjects = Subjects.of(settings.nats)

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    async def lookup(self, model_id: str, block_hashes: list[int], salt: str = "") -> LookupResult:
        """How many leading blocks of ``block_hashes`` (chain hashes, prefix order) the cache holds."""
        if not self.enabled:
            return LookupResult(0, error="disabled")
        req = CacheLookup(model_id=model_id, block_hashes=list(block_hashes), salt=salt)
        try:
            msg = await self._nc.request(
                self.subjects.cache_lookup,
                encode(req),
                timeout=self._cfg.lookup_timeout_s,
                headers=inject_headers(),
            )
            answer = msgspec.json.decode(msg.data, type=CacheLookupAnswer)
        except Exception as e:  # a cache is optional: unreachable is a miss, not a failure
            log.info("cache lookup failed", extra=fields(model=model_id, error=repr(e)))
            return LookupResult(0, error=repr(e))
        if isinstance(answer, ErrorMessage):
            return LookupResult(0, error=f"{answer.code}: {answer.message}")
        return LookupResult(answer.num_hit_blocks, answer.miss_reason)

    async def fetch(
        self, model_id: str, block_hashes: list[int], salt: str = ""
    ) -> KvBlocks | None:
        """KV of the leading held blocks of ``block_hashes`` (maybe fewer than asked), or None."""
        if not self.enabled or not block_hashes:
            return None
        try:
            async with asyncio.timeout(self._cfg.fetch_timeout_s):
                return await self._fetch(model_id, list(block_hashes), salt)
        except Exception as e:  # a cache is optional: any failure is a miss
            log.info("cache fetch failed", extra=fields(model=model_id, error=repr(e)))
            return None

    async def _fetch(self, model_id: str, hashes: list[int], salt: str) -> KvBlocks | None:
        inbox = self._nc.new_inbox()
        arrived: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            arrived.put_nowait(msg)

        # Subscribed before the request goes out (same connection: the server sees SUB first).
        sub = await self._nc.subscribe(inbox, cb=on_msg)
        try:
            req = CacheFetch(model_id=model_id, block_hashes=hashes, salt=salt)
            await self._nc.publish(
                self.subjects.cache_fetch, encode(req), reply=inbox, headers=inject_headers()
            )
            head: CacheFetchReply | None = None
            chunks: dict[int, bytes] = {}
            while head is None or len(chunks) < head.num_chunks:
                msg = await arrived.get()
                index = (msg.headers or {}).get(CHUNK_HEADER)
                if index is not None:
                    chunks[int(index)] = msg.data
                    continue
                answer = msgspec.json.decode(msg.data, type=CacheFetchAnswer)
                if isinstance(answer, ErrorMessage):
                    raise FetchError(f"{answer.code}: {answer.message}")
                if answer.num_blocks == 0:
                    return None
                head = answer
        finally:
            await sub.unsubscribe()
        kv = kv_transfer.decode(join_chunks(chunks, head.num_chunks, head.total_bytes))
        if kv.header.model_id != model_id or kv.header.block_hashes != hashes[: head.num_blocks]:
            raise FetchError("fetched blocks are not the leading blocks asked for")
        return kv

    async def store(self, kv: KvBlocks, salt: str = "") -> None:
        """Send ``kv``'s blocks to the cache; returns once they are handed to the NATS client
        (no reply is awaited, nothing is raised). Call it off the request's critical path."""
        if not self.enabled:
            return
        try:
            payload = kv_transfer.encode(kv)
            pieces = kv_transfer.split(payload, chunk_limit(self._nc, self._settings))
            head = CacheStore(
                transfer_id=uuid.uuid4().hex,
                total_bytes=len(payload),
                num_chunks=len(pieces),
                salt=salt,
            )
            headers = inject_headers()
            subject = self.subjects.cache_store
            await self._nc.publish(subject, encode(head), headers=headers)
            await publish_chunks(
                self._nc, subject, pieces, {**headers, TRANSFER_HEADER: head.transfer_id}
            )
        except Exception as e:  # a cache is optional: a lost store costs a future miss only
            log.warning("cache store failed", extra=fields(model=kv.header.model_id, error=repr(e)))
