"""The prefix-cache service's messages and the chunk framing of KV bytes over NATS.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from libs.protocol.base import PROTOCOL_VERSION, Struct
from libs.protocol.stream import ErrorMessage

# The cache service (services/cache, docs/cache.md) holds KV blocks keyed by
# (model_id, salt, chain hash). Three request shapes:
#
#   lookup: CacheLookup --request/reply--> CacheLookupReply | ErrorMessage
#   fetch:  CacheFetch (reply = an inbox the requester subscribed to first) --> on that inbox:
#           1 message  CacheFetchReply | ErrorMessage (JSON, no chunk header), then
#           num_chunks messages of raw bytes, each with header CHUNK_HEADER = its index
#           (0-based); their concatenation is libs/engine/kv_transfer.encode() of the hits.
#   store:  fire-and-forget on cache_store: 1 message CacheStore (JSON), then num_chunks raw
#           messages with headers TRANSFER_HEADER = CacheStore.transfer_id and CHUNK_HEADER =
#           index; their concatenation is kv_transfer.encode() of the blocks to store.
#
# Chunks are at most min(nats.max_payload, the server's max_payload) - CHUNK_HEADROOM_BYTES
# (or cache.chunk_bytes when set), so any KV size crosses NATS. One publisher's messages to
# one subscriber arrive in order in NATS, so the JSON head comes before its chunks.

# NATS header naming a chunk's 0-based index in its transfer.
CHUNK_HEADER = "Strait-Chunk"
# NATS header naming the transfer (CacheStore.transfer_id) a store chunk belongs to.
TRANSFER_HEADER = "Strait-Transfer"
# Bytes of max_payload left for a chunk's NATS headers (chunk ids and trace context).
CHUNK_HEADROOM_BYTES = 1024

# Why a lookup's first missing block missed (every later block misses with it: a chain).
CacheMissReason = Literal[
    "shorter_than_one_block",  # no full block asked about
    "evicted",  # held once, evicted from every tier since
    "other_model",  # this hash is held, under another model id
    "salt",  # this hash is held for this model, under another salt
    "not_stored",  # never held (or forgotten past cache.evicted_history)
]


class CacheLookup(Struct, kw_only=True):
    """How many leading blocks of a prefix does the cache hold? (``Subjects.cache_lookup``)"""

    v: int = PROTOCOL_VERSION
    model_id: Annotated[str, msgspec.Meta(min_length=1)]
    block_hashes: list[int]  # chain hashes (libs/engine/hashing.py), in prefix order
    salt: str = ""  # isolates tenants: a block stored under one salt never hits under another


class CacheLookupReply(Struct, kw_only=True, tag="cache_lookup"):
    """Answer to CacheLookup: leading hits, and why the first miss missed."""

    v: int = PROTOCOL_VERSION
    num_hit_blocks: int
    miss_reason: CacheMissReason | None = None  # None: every block asked about is held


class CacheFetch(Struct, kw_only=True):
    """Send me the KV bytes of the leading held blocks of this prefix (``Subjects.cache_fetch``)."""

    v: int = PROTOCOL_VERSION
    model_id: Annotated[str, msgspec.Meta(min_length=1)]
    block_hashes: list[int]  # chain hashes, in prefix order
    salt: str = ""


class CacheFetchReply(Struct, kw_only=True, tag="cache_fetch"):
    """Head of a fetch answer: what the ``num_chunks`` raw chunks that follow add up to."""

    v: int = PROTOCOL_VERSION
    num_blocks: int  # leading blocks in the payload (0: nothing held, no chunks follow)
    total_bytes: int = 0  # length of the kv_transfer-encoded payload
    num_chunks: int = 0
    miss_reason: CacheMissReason | None = None  # why block ``num_blocks`` is not in it


class CacheStore(Struct, kw_only=True):
    """Head of a store transfer (``Subjects.cache_store``); ``num_chunks`` raw chunks follow."""

    v: int = PROTOCOL_VERSION
    transfer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    total_bytes: Annotated[int, msgspec.Meta(ge=1)]  # length of the kv_transfer encoding
    num_chunks: Annotated[int, msgspec.Meta(ge=1)]
    salt: str = ""


class CacheEvent(Struct, kw_only=True):
    """Blocks the cache service started or stopped holding (JetStream, ``cache_events``).

    Replaying the stream from the start in order rebuilds the set of held blocks; ``cleared``
    means "forget everything this cache_id held before" (sent at service start).
    """

    v: int = PROTOCOL_VERSION
    cache_id: str
    model_id: str = ""
    salt: str = ""
    stored: list[int] = msgspec.field(default_factory=list)  # chain hashes
    evicted: list[int] = msgspec.field(default_factory=list)  # left every tier
    cleared: bool = False
    ts: float = msgspec.field(default_factory=time.time)


# What a lookup's or a fetch head's reply subject receives.
CacheLookupAnswer = CacheLookupReply | ErrorMessage
CacheFetchAnswer = CacheFetchReply | ErrorMessage
