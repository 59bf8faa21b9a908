"""NATS helpers shared by every service and the client library.

- ``connect``: a connection that reconnects forever and logs each state change.
- ``provision``: idempotent JetStream streams and consumers (create, or update to match).
- ``publish_msg`` / ``request_msg`` / ``publish_acked``: typed messages with W3C trace context
  in headers; JetStream publishes stored once per message id.
- ``publish_chunks``: a payload larger than ``max_payload`` as numbered chunks.

A request's token stream is read by ``libs.wire.stream_reader`` and written by
``libs.wire.stream_writer``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Placement,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
    SubjectTransform,
)
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError

from libs.log import fields
from libs.protocol import (
    CHUNK_HEADER,
    Subjects,
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


def regional_name(settings: NatsSettings, name: str, region: str | None = None) -> str:
    """The name of stream ``name`` of ``region`` (default: the process's own):
    ``<name>-<region>``, or ``name`` in a fleet of one region. Stream names are one namespace
    across a supercluster, so each region's copy needs its own."""
    region = settings.region if region is None else region
    return f"{name}-{region}" if region else name


def _placement(settings: NatsSettings, region: str | None = None) -> Placement | None:
    """The stream in ``region``'s cluster (the process's own by default); None: anywhere."""
    region = settings.region if region is None else region
    return Placement(cluster=region) if region else None


def stream_configs(settings: NatsSettings) -> list[StreamConfig]:
    """The JetStream streams of the process's region (every stream, in a fleet of one region),
    with their limits. The ledger's view of every region's events is ``ledger_stream_config``."""
    subjects = Subjects.of(settings)
    return [
        # The fleet's own requests; each team's have a stream of their own
        # (team_stream_config), which routers read beside this one.
        _requests_queue(
            settings,
            regional_name(settings, settings.requests_stream),
            subjects.requests,
            _placement(settings),
        ),
        events_stream_config(settings),
        cache_events_stream_config(settings),
    ]


def events_stream_config(settings: NatsSettings, region: str | None = None) -> StreamConfig:
    """Usage and route events of ``region`` (the process's own by default)."""
    subjects = Subjects(settings.subject_prefix, settings.region if region is None else region)
    return StreamConfig(
        name=regional_name(settings, settings.events_stream, region),
        subjects=[subjects.events_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.events_max_age_s,
        num_replicas=settings.stream_replicas,
        placement=_placement(settings, region),
    )


def fleet_regions(settings: NatsSettings) -> list[str]:
    """Every region of the fleet (``nats.regions``, else the process's own; [] for none)."""
    if settings.regions:
        return list(settings.regions)
    return [settings.region] if settings.region else []


def ledger_stream_config(settings: NatsSettings) -> StreamConfig:
    """The events the ledger writer reads, ``events_stream``. One region: the events stream
    itself. Regions: a stream of no subjects of its own, in ``ledger_region``'s cluster, that
    sources every region's events stream, each message's subject mapped back to the region-less
    one (``<prefix>.region.<r>.events.usage`` → ``<prefix>.events.usage``), so the ledger and
    every observer read one stream as with one region. A region cut off delays its rows: the
    source resumes from where it stopped when the link returns (decision 0029)."""
    regions = fleet_regions(settings)
    if not regions:
        return events_stream_config(settings)
    plain = Subjects(settings.subject_prefix)
    return StreamConfig(
        name=settings.events_stream,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.events_max_age_s,
        num_replicas=settings.stream_replicas,
        placement=_placement(settings, settings.ledger_region or regions[0]),
        sources=[
            StreamSource(
                name=regional_name(settings, settings.events_stream, r),
                subject_transforms=[
                    SubjectTransform(
                        src=Subjects(settings.subject_prefix, r).events_all,
                        dest=plain.events_all,
                    )
                ],
            )
            for r in regions
        ],
    )


def cache_events_stream_config(settings: NatsSettings) -> StreamConfig:
    """The prefix-cache service's stored/evicted events: kept (not consumed) so that any
    number of readers can replay them from the start to rebuild the set of held blocks."""
    return StreamConfig(
        name=regional_name(settings, settings.cache_events_stream),
        subjects=[Subjects.of(settings).cache_events],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=settings.cache_events_max_age_s,
        num_replicas=settings.stream_replicas,
        placement=_placement(settings),
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


def _requests_queue(
    settings: NatsSettings, name: str, subject: str, placement: Placement | None = None
) -> StreamConfig:
    """A work queue of requests on ``subject``, each kept once per ``Nats-Msg-Id``."""
    return StreamConfig(
        placement=placement,
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


async def publish_chunks(
    nc: NATS, subject: str, pieces: list[bytes], headers: dict[str, str]
) -> None:
    """Publish ``pieces`` in order, each with ``headers`` plus its index in CHUNK_HEADER."""
    for i, piece in enumerate(pieces):
        await nc.publish(subject, piece, headers={**headers, CHUNK_HEADER: str(i)})
