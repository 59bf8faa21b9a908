"""The prefix-cache service on a real nats-server: store → lookup → fetch, chunking past
max_payload, miss reasons, bad input, replayable events, and the client's failure modes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from bench.support.services import nats_server
from libs.engine import kv_transfer
from libs.engine.kv_transfer import KvBlocks
from libs.protocol import (
    CHUNK_HEADER,
    TRANSFER_HEADER,
    CacheEvent,
    CacheFetchReply,
    CacheLookup,
    CacheLookupAnswer,
    CacheLookupReply,
    CacheStore,
    DeadLetter,
    ErrorMessage,
    Subjects,
    encode,
)
from libs.runtime import ServiceContext
from libs.settings import Settings
from libs.wire.kv_cache_client import CacheClient
from services.cache.main import serve
from services.cache.service import CacheService
from services.cache.store import BlockKey
from tests.integration.cache.conftest import BLOCK, poll
from tests.support.kv_blocks import random_blocks, same_bits

pytestmark = pytest.mark.integration

M = "model-a"


async def until_held(cache: CacheClient, kv: KvBlocks, salt: str = "") -> None:
    """Stores are fire-and-forget: wait until the lookup sees every block."""
    want = len(kv.header.block_hashes)
    # Generous: on a loaded 2-core CI machine a lookup round trip can take seconds.
    deadline = time.monotonic() + 15.0
    answers = []
    while (
        answer := await cache.lookup(kv.header.model_id, kv.header.block_hashes, salt)
    ).num_hit_blocks < want:
        answers.append((answer.num_hit_blocks, answer.miss_reason, answer.error))
        assert time.monotonic() < deadline, (
            f"stored blocks never became visible; lookups said {answers[:3]} … {answers[-3:]}"
        )
        await asyncio.sleep(0.02)


async def until_answering(cache: CacheClient) -> None:
    """Until a lookup from the client's connection gets an answer: stores are fire-and-forget,
    so one published before the service is reachable is lost (a clean-clone CI run once saw
    the first lookup after ``service.start()`` on a fresh server get NoResponders)."""
    deadline = time.monotonic() + 15.0
    while (answer := await cache.lookup(M, [1])).error:
        assert time.monotonic() < deadline, f"the cache service never answered: {answer.error}"
        await asyncio.sleep(0.05)


async def test_store_lookup_fetch_round_trip_is_bit_exact(
    cache_service: CacheService, cache: CacheClient
) -> None:
    kv = random_blocks(M, 6, seed=1)
    before = await cache.lookup(M, kv.header.block_hashes)
    assert (before.num_hit_blocks, before.miss_reason, before.error) == (0, "not_stored", "")
    await cache.store(kv)
    await until_held(cache, kv)
    got = await cache.fetch(M, kv.header.block_hashes)
    assert got is not None and got.header.block_hashes == kv.header.block_hashes
    assert same_bits(got.data, kv.data)
    # A longer prompt sharing the prefix gets exactly the shared leading blocks.
    longer = [*kv.header.block_hashes[:4], *random_blocks(M, 2, seed=2).header.block_hashes]
    result = await cache.lookup(M, longer)
    assert (result.num_hit_blocks, result.miss_reason) == (4, "not_stored")
    part = await cache.fetch(M, longer)
    assert part is not None and same_bits(part.data, kv.data[:, :, :, :4])


async def test_payloads_larger_than_max_payload_travel_in_chunks(
    cache_settings: Settings, tmp_path: Path
) -> None:
    """A server whose max_payload is a fraction of the KV: every transfer is several chunks."""
    with nats_server(tmp_path / "small", max_payload=32 * 1024) as url:
        cache_settings.nats.url = url
        cache_settings.cache.memory_bytes = 1024 * 1024
        service_nc, client_nc = await nats.connect(url), await nats.connect(url)
        service = CacheService(service_nc, service_nc.jetstream(), cache_settings)
        await service.start()
        chunks: list[int] = []

        async def count(msg: Msg) -> None:
            if (msg.headers or {}).get(CHUNK_HEADER) is not None:
                chunks.append(len(msg.data))

        await client_nc.subscribe(
            Subjects(cache_settings.nats.subject_prefix).cache_store, cb=count
        )
        try:
            cache = CacheClient(client_nc, cache_settings)
            # 2 layers * 2 * 4 heads * 16 blocks * 16 tokens * 32 dims * 4 bytes = 512 KiB
            kv = random_blocks(M, 16, seed=3, kv_heads=4, block_size=16, head_dim=32)
            assert len(kv_transfer.encode(kv)) > 4 * client_nc.max_payload
            await until_answering(cache)
            await cache.store(kv)
            await until_held(cache, kv)
            assert len(chunks) > 4 and max(chunks) <= client_nc.max_payload
            got = await cache.fetch(M, kv.header.block_hashes)
            assert got is not None and same_bits(got.data, kv.data)
        finally:
            await service.close(5.0)
            await service_nc.drain()
            await client_nc.drain()


async def test_misses_name_their_reason(cache_service: CacheService, cache: CacheClient) -> None:
    kv = random_blocks(M, 2, seed=1)
    await cache.store(kv, salt="tenant-1")
    await until_held(cache, kv, salt="tenant-1")
    hashes = kv.header.block_hashes
    assert (await cache.lookup(M, hashes, salt="tenant-2")).miss_reason == "salt"
    assert (await cache.lookup("model-b", hashes, salt="tenant-1")).miss_reason == "other_model"
    assert (await cache.lookup(M, [])).miss_reason == "shorter_than_one_block"
    assert await cache.fetch(M, hashes, salt="tenant-2") is None
    assert await cache.fetch("model-b", hashes, salt="tenant-1") is None
    stats = cache_service.store.stats
    assert stats.misses[("lookup", "salt")] == 1 and stats.misses[("fetch", "other_model")] == 1


async def test_bad_input_gets_a_typed_answer_and_the_service_keeps_serving(
    cache_service: CacheService, cache: CacheClient, client_nc: NATS, cache_settings: Settings
) -> None:
    subjects = Subjects(cache_settings.nats.subject_prefix)
    letters: list[DeadLetter] = []

    async def on_letter(msg: Msg) -> None:
        letters.append(msgspec.json.decode(msg.data, type=DeadLetter))

    await client_nc.subscribe(subjects.deadletter, cb=on_letter)

    async def ask(subject: str, data: bytes) -> CacheLookupReply | CacheFetchReply | ErrorMessage:
        reply = await client_nc.request(subject, data, timeout=2.0)
        answer: CacheLookupReply | CacheFetchReply | ErrorMessage = msgspec.json.decode(
            reply.data, type=CacheLookupReply | CacheFetchReply | ErrorMessage
        )
        return answer

    for data, code in (
        (b"not json", "invalid_request"),
        (b'{"v": 1, "model_id": "m"}', "invalid_request"),  # no block_hashes
        (b'{"v": 1, "model_id": "m", "block_hashes": ["x"]}', "invalid_request"),
        (b'{"v": 99, "model_id": "m", "block_hashes": []}', "unsupported_version"),
    ):
        for subject in (subjects.cache_lookup, subjects.cache_fetch):
            answer = await ask(subject, data)
            assert isinstance(answer, ErrorMessage) and answer.code == code, (subject, data)

    # No reply subject to answer on: dead letters.
    await client_nc.publish(subjects.cache_store, b"{broken")
    await client_nc.publish(subjects.cache_fetch, encode(CacheLookup(model_id=M, block_hashes=[])))
    # A well-formed store head whose chunks are not a KV payload.
    head = CacheStore(transfer_id="bad-1", total_bytes=5, num_chunks=1)
    await client_nc.publish(subjects.cache_store, encode(head))
    await client_nc.publish(
        subjects.cache_store, b"12345", headers={TRANSFER_HEADER: "bad-1", CHUNK_HEADER: "0"}
    )
    # A chunk index outside the transfer.
    head = CacheStore(transfer_id="bad-2", total_bytes=5, num_chunks=1)
    await client_nc.publish(subjects.cache_store, encode(head))
    await client_nc.publish(
        subjects.cache_store, b"12345", headers={TRANSFER_HEADER: "bad-2", CHUNK_HEADER: "7"}
    )
    await poll(lambda: len(letters) == 4, what="four dead letters")
    assert {d.subject for d in letters} == {subjects.cache_store, subjects.cache_fetch}
    assert all(d.service == "cache" for d in letters)

    kv = random_blocks(M, 3, seed=5)
    await cache.store(kv)
    await until_held(cache, kv)
    got = await cache.fetch(M, kv.header.block_hashes)
    assert got is not None and same_bits(got.data, kv.data)


async def test_events_replay_to_exactly_the_held_blocks(
    cache_settings: Settings, cache_service: CacheService, cache: CacheClient, client_nc: NATS
) -> None:
    """A reader that joins late (a restarted router) rebuilds the held set from the stream."""
    cache_service.store.memory_budget = 5 * BLOCK
    stores = [random_blocks(M, 3, seed=i) for i in range(4)]
    for kv in stores:
        await cache.store(kv)
        await until_held(cache, kv)
    await poll(lambda: cache_service._events.empty(), what="events published")
    await asyncio.sleep(0.1)  # the last JetStream publish ack

    js = client_nc.jetstream()
    sub = await js.subscribe(
        Subjects(cache_settings.nats.subject_prefix).cache_events,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    held: set[BlockKey] = set()
    events: list[CacheEvent] = []
    info = await js.stream_info(cache_settings.nats.cache_events_stream)
    for _ in range(info.state.messages):
        msg = await sub.next_msg(timeout=2.0)
        ev = msgspec.json.decode(msg.data, type=CacheEvent)
        events.append(ev)
        if ev.cleared:
            held.clear()
        held |= {BlockKey(ev.model_id, ev.salt, h) for h in ev.stored}
        held -= {BlockKey(ev.model_id, ev.salt, h) for h in ev.evicted}
    await sub.unsubscribe()
    assert events[0].cleared and any(ev.evicted for ev in events)
    expected = {
        BlockKey(M, "", h)
        for kv in stores
        for h in kv.header.block_hashes
        if cache_service.store.tier(BlockKey(M, "", h)) is not None
    }
    assert held == expected and len(held) == 5


async def test_a_missing_cache_is_a_miss_not_a_failure(cache_settings: Settings, nc: NATS) -> None:
    cache_settings.cache.fetch_timeout_s = 0.3
    cache = CacheClient(nc, cache_settings)  # type: ignore[arg-type]
    kv = random_blocks(M, 2, seed=1)
    t0 = time.monotonic()
    assert await cache.fetch(M, kv.header.block_hashes) is None
    assert time.monotonic() - t0 < 2.0
    result = await cache.lookup(M, kv.header.block_hashes)
    assert result.num_hit_blocks == 0 and result.error
    await cache.store(kv)  # nobody listens: no error either

    cache_settings.cache.enabled = False
    off = CacheClient(nc, cache_settings)  # type: ignore[arg-type]
    assert (await off.lookup(M, kv.header.block_hashes)).error == "disabled"
    assert await off.fetch(M, kv.header.block_hashes) is None


async def test_the_service_entry_serves_until_stopped(cache_settings: Settings) -> None:
    ctx = ServiceContext(name="cache", settings=cache_settings)
    task = asyncio.create_task(serve(ctx))
    conn = await nats.connect(cache_settings.nats.url)
    try:
        await poll(lambda: ctx.ready(), what="cache ready")
        reply = await conn.request(
            Subjects(cache_settings.nats.subject_prefix).cache_lookup,
            encode(CacheLookup(model_id=M, block_hashes=[1, 2])),
            timeout=2.0,
        )
        answer = msgspec.json.decode(reply.data, type=CacheLookupAnswer)
        assert answer == CacheLookupReply(num_hit_blocks=0, miss_reason="not_stored")
        ctx.stopping.set()
        await asyncio.wait_for(task, timeout=10.0)
    finally:
        task.cancel()
        await conn.drain()
