"""The prefix-cache service's settings (`strait cache`) and its client's in the workers."""

from __future__ import annotations

from libs.settings.section import Section


class CacheSettings(Section):
    """The prefix-cache service (`strait cache`, docs/cache.md) and its client."""

    enabled: bool = False
    """Workers look up, fetch and store prefix blocks in the cache service only when true
    (libs/wire/kv_cache_client.CacheClient answers "disabled" without touching NATS otherwise)."""
    memory_bytes: int = 1024 * 1024 * 1024
    """Memory tier budget: bytes of KV tensor data held (index overhead not counted)."""
    disk_dir: str = ""
    """Disk tier: blocks evicted from memory spill to files here; empty: no disk tier.
    The directory is the service's own: its block files are deleted at start."""
    disk_bytes: int = 8 * 1024 * 1024 * 1024
    """Disk tier budget: bytes of block files kept under `disk_dir`."""
    lookup_timeout_s: float = 0.5
    """Client: seconds to wait for a lookup reply."""
    fetch_timeout_s: float = 5.0
    """Client: seconds to wait for a whole fetch (head + chunks)."""
    chunk_bytes: int = 0
    """Bytes of KV data per NATS message; 0: the smaller of nats.max_payload and the server's
    max_payload, less libs.protocol.CHUNK_HEADROOM_BYTES for headers."""
    store_timeout_s: float = 10.0
    """Service: a store whose chunks are not all in after this many seconds is dropped."""
    max_pending_store_bytes: int = 256 * 1024 * 1024
    """Service: bytes of stores being reassembled at once; a store past it is refused."""
    evicted_history: int = 100_000
    """Service: evicted keys remembered so a later miss says "evicted" (not "not_stored")."""
    event_queue: int = 10_000
    """Service: events waiting to be published to JetStream; handlers wait when it is full."""
    cache_id: str = ""
    """This service's id in its cache events and logs; empty: derived from host and pid."""
    metrics_port: int = 9102
    """Port of the /health, /ready, /metrics listener; 0: none."""
