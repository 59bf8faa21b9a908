"""NATS: the connection every process opens, the subject prefix and the JetStream streams."""

from __future__ import annotations

from pydantic import Field

from libs.settings.section import Section


class NatsSettings(Section):
    url: str = "nats://127.0.0.1:4222"
    """One server, or a cluster's servers comma-separated (clients fail over between them).
    `NATS_URL` sets it too (`STRAIT_NATS__URL` wins)."""
    subject_prefix: str = "strait.v1"
    """First tokens of every subject (`<prefix>.requests`, `<prefix>.stream.<id>`, ...); the
    version is part of it."""
    max_payload: int = 8 * 1024 * 1024
    """Bytes; must not exceed the server's max_payload. `strait up` starts its own server with this."""
    connect_timeout_s: float = 2.0
    """Seconds one connection attempt to a server may take."""
    region: str = Field(default="", pattern=r"^([a-z0-9][a-z0-9-]{0,31})?$")
    """The region this process is in: the name of its NATS cluster in a supercluster of
    clusters joined by gateways (docs/regions.md). Its requests, events and prefix-cache
    subjects become `<prefix>.region.<region>.…`, its streams `<name>-<region>`, placed in
    that cluster; workers announce it in their beats and routers place in it first. Empty:
    one region (every name as without regions)."""
    regions: list[str] = Field(default_factory=list)
    """Every region of the fleet: the ledger's events stream (`events_stream`) sources each
    one's events stream (`<events_stream>-<region>`). Empty: this process's region alone."""
    ledger_region: str = ""
    """The region whose cluster holds `events_stream`, the ledger's view of every region's
    usage (empty: the first of `regions`); the ledger writer runs there."""
    requests_stream: str = "STRAIT_REQUESTS"
    """The requests queue (the routers' work queue). Every stream is provisioned idempotently,
    by name."""
    events_stream: str = "STRAIT_EVENTS"
    """Usage and route events (the ledger writer's input)."""
    kv_events_stream: str = "STRAIT_KV_EVENTS"
    """Workers' KV stored/evicted events."""
    cache_events_stream: str = "STRAIT_CACHE_EVENTS"
    """The prefix-cache service's stored/evicted events (replayable index of held blocks)."""
    batch_stream: str = "STRAIT_BATCH"
    """The Batch API's lines (BatchLine), consumed by the batch runners (docs/gateway.md)."""
    request_max_age_s: float = 300.0
    """Keep at most this long in the requests stream before a router takes it."""
    request_dedupe_window_s: float = 120.0
    """Seconds a request's Nats-Msg-Id is remembered: a publish repeated within it (a lost ack)
    is stored once. Each team's requests have their own window (their own stream)."""
    events_max_age_s: float = 7 * 24 * 3600.0
    """Seconds usage and route events are kept in their stream."""
    cache_events_max_age_s: float = 24 * 3600.0
    """Cache events older than this leave the stream; a replay then misses blocks stored
    earlier that are still held (the index under-reports, it never over-reports for long)."""
    stream_replicas: int = 1
    """Copies of each JetStream stream in a NATS cluster (1 on one server; 3 on the 3-node
    cluster of deploy/k8s, so a lost node loses no queued request or usage event)."""
    monitor_port: int = 8222
    """HTTP monitoring port, on the server's host, of the nats-server that `strait up --secure`
    starts: `strait teams` reads it to know when the server has taken a change of teams."""
    nkey_seed_file: str = ""
    """Credentials (docs/security.md; empty: none, the embedded single-account server).
    An nkey seed file ("SU..."): the fleet's own in a secured fleet (`strait up --secure`)."""
    tls_ca_file: str = ""
    """Verify the server's certificate against this CA (PEM); set, connections use TLS."""
    tls_cert_file: str = ""
    """A client certificate and key (PEM), for servers that verify clients too."""
    tls_key_file: str = ""
    """The key of `tls_cert_file` (PEM)."""
