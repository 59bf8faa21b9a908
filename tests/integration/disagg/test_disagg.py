"""Disaggregated prefill/decode on a real nats-server with a tiny random-weight model: the answer
never changes across the KV handoff, and every failure of the handoff ends clearly."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest
import torch

from bench.support.fleet import InProcessFleet, WorkerHandle
from bench.support.tiny_models import save_tiny_model_dir
from libs.client import StraitClient
from libs.engine.async_engine import AsyncEngineBackend
from libs.engine.hashing import chain_hashes
from libs.protocol import (
    Assignment,
    CancelRequest,
    ErrorMessage,
    Finished,
    GenerateRequest,
    HandoffAbort,
    HandoffCommit,
    HandoffOffer,
    HandoffReply,
    HandoffResult,
    RouteReason,
    SamplingParams,
    Subjects,
    TokenDelta,
    decode_stream,
    encode,
)
from libs.settings import EngineSettings, PoolSettings, Settings
from libs.wire.kv_cache_client import CacheClient
from libs.wire.nats_util import provision
from services.cache.service import CacheService
from services.worker import metrics
from tests.unit.engine.helpers import reference_greedy

pytestmark = pytest.mark.integration

MODEL = "tiny"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@dataclass
class Fleet:
    fleet: InProcessFleet
    settings: Settings
    model: torch.nn.Module
    prefill: WorkerHandle
    decoders: list[WorkerHandle]
    prefills: list[WorkerHandle]
    aggregated: WorkerHandle
    cache: CacheService


@pytest.fixture
def with_cache() -> bool:
    return False


@pytest.fixture
async def disagg(settings: Settings, tmp_path: Path, with_cache: bool) -> AsyncIterator[Fleet]:
    """Pools ``agg`` (one aggregated worker) and ``dis`` (prefill dis-p0, decode dis-d0 and
    dis-d1; with ``with_cache``, a second prefill dis-p1 and the prefix-cache service)."""
    from transformers import AutoModelForCausalLM

    save_tiny_model_dir(tmp_path / "models" / MODEL)
    settings.models.dir = str(tmp_path / "models")
    settings.engine = EngineSettings(
        block_size=4, kv_cache_bytes=4 * 2**20, max_model_len=256, num_threads=1
    )
    settings.pools = [
        PoolSettings(name="agg", model=MODEL, mode="aggregated"),
        PoolSettings(name="dis", model=MODEL, mode="disaggregated"),
    ]
    settings.handoff.request_timeout_s = 1.0
    settings.handoff.reservation_ttl_s = 2.0
    path = str(tmp_path / "models" / MODEL)

    def engine() -> AsyncEngineBackend:
        return AsyncEngineBackend(settings.engine, path, MODEL)

    nc = await nats.connect(settings.nats.url)
    await provision(nc.jetstream(), settings.nats)
    await nc.drain()
    settings.cache.enabled = with_cache
    service_nc = await nats.connect(settings.nats.url)
    service = CacheService(service_nc, service_nc.jetstream(), settings)
    if with_cache:
        await service.start()
    async with InProcessFleet(settings) as f:
        agg = await f.add_worker("agg-w0", pool="agg", backend=engine())
        prefills = [
            await f.add_worker(
                f"dis-p{i}",
                pool="dis",
                backend=engine(),
                role="prefill",
                cache=CacheClient(service_nc, settings) if with_cache else None,
            )
            for i in range(2 if with_cache else 1)
        ]
        decoders = [
            await f.add_worker(f"dis-d{i}", pool="dis", backend=engine(), role="decode")
            for i in range(2)
        ]
        await f.wait_workers(4)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        yield Fleet(f, settings, model, prefills[0], decoders, prefills, agg, service)
        for h in f.workers:
            await h.backend.stop()
    if with_cache:
        await service.close(drain_timeout_s=2.0)
    await service_nc.drain()


def prompts(n: int) -> list[list[int]]:
    # Lengths 5..40: shorter than one block of 4 is impossible here, partial last blocks vary.
    return [[(7 * i + 3 * j) % 300 + 3 for j in range(5 + 7 * i)] for i in range(n)]


async def run(client: StraitClient, pool: str, ids: list[int], **kw: object):
    return await client.complete(
        prompt_token_ids=ids,
        model=pool,
        max_tokens=GREEDY.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        **kw,  # type: ignore[arg-type]
    )


async def test_disaggregated_output_equals_aggregated_and_generate(disagg: Fleet) -> None:
    batch = prompts(6)
    async with StraitClient.from_settings(disagg.settings) as client:
        for round_ in range(2):  # the second round hits the prefill worker's prefix cache
            dis, agg = await asyncio.gather(
                asyncio.gather(*(run(client, "dis", p) for p in batch)),
                asyncio.gather(*(run(client, "agg", p) for p in batch)),
            )
            for ids, d, a in zip(batch, dis, agg, strict=True):
                expected = reference_greedy(disagg.model, ids, GREEDY.max_tokens)
                assert d.token_ids[0] == a.token_ids[0] == expected
                assert d.text == a.text
                assert d.finish_reasons == ["length"]
                assert d.usage.prompt_tokens == len(ids)
                assert d.usage.completion_tokens == GREEDY.max_tokens
                assert d.finished.worker_id.startswith("dis-d")
                if round_ == 1:
                    assert d.usage.cached_tokens == (len(ids) - 1) // 4 * 4
    # Nothing stranded: every block is free (cached blocks count as free) on every worker.
    for h in [disagg.prefill, *disagg.decoders]:
        assert h.backend.load().kv_blocks_used == 0
        assert not h.worker.tasks


async def test_seeded_sampling_and_several_choices_cross_the_handoff_unchanged(
    disagg: Fleet,
) -> None:
    ids = prompts(5)[4]
    async with StraitClient.from_settings(disagg.settings) as client:
        for kw in (
            dict(temperature=0.9, top_p=0.9, seed=7, logprobs=2),
            dict(temperature=0.8, seed=3, n=3, frequency_penalty=0.5),
        ):
            dis, agg = [
                await client.complete(
                    prompt_token_ids=ids, model=pool, max_tokens=8, ignore_eos=True, **kw
                )
                for pool in ("dis", "agg")
            ]
            assert dis.token_ids == agg.token_ids and dis.texts == agg.texts
            assert len(dis.token_ids) == kw.get("n", 1)
            assert dis.finished.worker_id.startswith("dis-d")


async def test_blocks_the_decode_worker_holds_are_not_sent_again(disagg: Fleet) -> None:
    ids = prompts(6)[5]  # 40 tokens: 10 full blocks of 4
    longer = [*ids, 9, 8, 7, 6, 5, 4, 3, 2]  # 12 full blocks, the first 10 shared
    sent = metrics.HANDOFF_BYTES.labels(side="prefill")
    per_block = None
    expected = {
        tuple(p): reference_greedy(disagg.model, p, GREEDY.max_tokens) for p in (ids, longer)
    }
    for prompt, new_blocks in ((ids, 10), (ids, 0), (longer, 2)):
        before = sent._value.get()
        messages = await assign_and_read(disagg, assignment(disagg, prompt, ["dis-d0"]))
        tokens = [t for m in messages if isinstance(m, TokenDelta) for t in m.token_ids]
        assert tokens == expected[tuple(prompt)]
        delta = sent._value.get() - before
        per_block = per_block or delta / new_blocks
        # kv_transfer's JSON header makes a payload a little more than its blocks' bytes
        assert new_blocks * per_block * 0.9 <= delta <= new_blocks * per_block * 1.1 + 1


async def test_a_request_that_ends_at_its_first_token_never_leaves_prefill(disagg: Fleet) -> None:
    async with StraitClient.from_settings(disagg.settings) as client:
        c = await client.complete(
            prompt_token_ids=prompts(2)[1], model="dis", max_tokens=1, temperature=0.0
        )
    assert c.finished.worker_id == "dis-p0"
    assert c.finish_reasons == ["length"] and len(c.token_ids[0]) == 1


async def test_a_draining_decode_worker_refuses_and_another_takes_the_request(
    disagg: Fleet,
) -> None:
    d0 = disagg.decoders[0]
    d0.worker.draining = True  # refuses offers, beats still say "live" until the next beat
    refused = metrics.HANDOFFS.labels(side="decode", outcome="refused_draining")
    before = refused._value.get()
    a = assignment(disagg, prompts(3)[2], ["dis-d0", "dis-d1"])
    messages = await assign_and_read(disagg, a)
    assert isinstance(messages[-1], Finished) and messages[-1].worker_id == "dis-d1"
    assert refused._value.get() == before + 1
    d0.worker.draining = False


async def test_decode_worker_that_never_commits_is_aborted_and_the_next_one_serves(
    disagg: Fleet,
) -> None:
    """A decode worker that accepts and then goes silent (it died mid-handoff): the prefill
    worker times out on the commit, tells it to forget the transfer, and hands off elsewhere."""
    s = Subjects(disagg.settings.nats.subject_prefix)
    nc = await nats.connect(disagg.settings.nats.url)
    aborts: list[HandoffAbort] = []

    async def accept(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(
            encode(HandoffReply(accepted=True, kv_subject=s.handoff_kv("ghost", "x")))
        )

    async def abort(msg: nats.aio.msg.Msg) -> None:
        aborts.append(msgspec.json.decode(msg.data, type=HandoffAbort))

    async def ignore(msg: nats.aio.msg.Msg) -> None:  # a commit nobody answers
        return None

    await nc.subscribe(s.handoff_offer("ghost"), cb=accept)
    await nc.subscribe(s.handoff_commit("ghost"), cb=ignore)
    await nc.subscribe(s.handoff_abort("ghost"), cb=abort)
    ids = prompts(4)[3]
    messages = await assign_and_read(disagg, assignment(disagg, ids, ["ghost", "dis-d0"]))
    tokens = [t for m in messages if isinstance(m, TokenDelta) for t in m.token_ids]
    assert tokens == reference_greedy(disagg.model, ids, GREEDY.max_tokens)
    assert isinstance(messages[-1], Finished) and messages[-1].worker_id == "dis-d0"
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert len(aborts) == 1 and aborts[0].request_id == messages[-1].request_id
    assert aborts[0].reason == "no answer to the commit"

    # Every decode worker silent: the client gets a typed error, never silence.
    messages = await assign_and_read(disagg, assignment(disagg, ids, ["ghost"]))
    assert len(messages) == 1 and isinstance(messages[0], ErrorMessage)
    assert messages[0].code == "no_capacity" and "ghost" in messages[0].message
    await nc.drain()


async def test_a_cancel_during_the_handoff_releases_the_decode_side(disagg: Fleet) -> None:
    """The client cancels while the prefill worker waits on a commit: the decode side is told
    (HandoffAbort "cancelled"), and a decode worker that saw the cancel refuses the commit."""
    s = Subjects(disagg.settings.nats.subject_prefix)
    nc = await nats.connect(disagg.settings.nats.url)
    aborts: list[HandoffAbort] = []
    offered = asyncio.Event()

    async def accept(msg: nats.aio.msg.Msg) -> None:  # accepts, then never answers the commit
        offered.set()
        await msg.respond(
            encode(HandoffReply(accepted=True, kv_subject=s.handoff_kv("ghost", "x")))
        )

    async def abort(msg: nats.aio.msg.Msg) -> None:
        aborts.append(msgspec.json.decode(msg.data, type=HandoffAbort))

    async def ignore(msg: nats.aio.msg.Msg) -> None:  # a commit nobody answers
        return None

    await nc.subscribe(s.handoff_offer("ghost"), cb=accept)
    await nc.subscribe(s.handoff_commit("ghost"), cb=ignore)
    await nc.subscribe(s.handoff_abort("ghost"), cb=abort)
    a = assignment(disagg, prompts(3)[2], ["ghost"])
    rid = a.request.request_id
    await nc.request(s.work("dis-p0"), encode(a), timeout=5)
    await asyncio.wait_for(offered.wait(), 10)
    await asyncio.sleep(0.2)  # the prefill worker is now waiting on its commit
    await nc.publish(s.cancel(rid), encode(CancelRequest(request_id=rid)))
    for _ in range(50):
        if aborts:
            break
        await asyncio.sleep(0.02)
    assert [(x.request_id, x.reason) for x in aborts] == [(rid, "cancelled")]
    await assert_idle(disagg)

    # A real decode worker that has seen the cancel refuses a late commit for that request.
    d0 = disagg.decoders[0]
    assert rid in d0.worker.recently_cancelled
    late = HandoffOffer(
        transfer_id="late",
        assignment=a,
        prefill_worker_id="dis-p0",
        prompt_token_ids=prompts(3)[2],
        first_token_id=5,
    )
    reply = await nc.request(s.handoff_offer("dis-d0"), encode(late), timeout=2)
    assert msgspec.json.decode(reply.data, type=HandoffReply).accepted
    commit = HandoffCommit(transfer_id="late", request_id=rid)
    reply = await nc.request(s.handoff_commit("dis-d0"), encode(commit), timeout=2)
    result = msgspec.json.decode(reply.data, type=HandoffResult)
    assert not result.ok and result.reason == "cancelled"
    assert rid not in d0.worker.tasks
    await nc.drain()


async def test_an_uncommitted_reservation_expires_and_strands_nothing(disagg: Fleet) -> None:
    """A prefill worker that dies after the offer: the decode side drops the reservation."""
    s = Subjects(disagg.settings.nats.subject_prefix)
    nc = await nats.connect(disagg.settings.nats.url)
    a = assignment(disagg, prompts(2)[1], ["dis-d1"])
    offer = HandoffOffer(
        transfer_id="t1",
        assignment=a,
        prefill_worker_id="gone",
        prompt_token_ids=prompts(2)[1],
        first_token_id=5,
        block_hashes=[1, 2],
        kv_bytes=100,
    )
    reply = await nc.request(s.handoff_offer("dis-d1"), encode(offer), timeout=2)
    assert msgspec.json.decode(reply.data, type=HandoffReply).accepted
    await asyncio.sleep(disagg.settings.handoff.reservation_ttl_s + 1.0)
    commit = HandoffCommit(transfer_id="t1", request_id=a.request.request_id)
    reply = await nc.request(s.handoff_commit("dis-d1"), encode(commit), timeout=2)
    result = msgspec.json.decode(reply.data, type=HandoffResult)
    assert not result.ok and result.reason == "unknown_transfer"
    assert disagg.decoders[1].backend.load().kv_blocks_used == 0
    assert a.request.request_id not in disagg.decoders[1].worker.tasks
    await nc.drain()


async def test_malformed_handoff_messages_get_typed_answers(disagg: Fleet) -> None:
    s = Subjects(disagg.settings.nats.subject_prefix)
    nc = await nats.connect(disagg.settings.nats.url)
    for payload in (b"not json", b'{"v": 1}', b'{"v": 99, "transfer_id": "x"}'):
        reply = await nc.request(s.handoff_offer("dis-d0"), payload, timeout=2)
        answer = msgspec.json.decode(reply.data, type=HandoffReply)
        assert not answer.accepted and answer.reason
        reply = await nc.request(s.handoff_commit("dis-d0"), payload, timeout=2)
        assert not msgspec.json.decode(reply.data, type=HandoffResult).ok
    # Chunks of a transfer nobody offered are dropped; the worker still serves.
    await nc.publish(s.handoff_kv("dis-d0", "nobody"), b"\x00" * 10)
    await nc.drain()
    async with StraitClient.from_settings(disagg.settings) as client:
        c = await run(client, "dis", prompts(1)[0])
    assert c.finish_reasons == ["length"]


@pytest.mark.parametrize("with_cache", [True])
async def test_a_prefix_stored_by_one_prefill_worker_is_fetched_by_another(
    disagg: Fleet,
) -> None:
    """dis-p0 prefills a prompt and stores its blocks in the cache service; dis-p1 has never
    seen it, fetches them, computes only the rest, and the answer is unchanged."""
    ids = prompts(6)[5]  # 40 tokens: 9 full blocks before the last token
    first = await assign_and_read(disagg, assignment(disagg, ids, ["dis-d0"]), prefill="dis-p0")
    hashes = chain_hashes(ids[:36], 4, MODEL)
    nc = await nats.connect(disagg.settings.nats.url)
    client = CacheClient(nc, disagg.settings)
    for _ in range(100):  # the store is off the critical path: wait for it to land
        if (await client.lookup(MODEL, hashes)).num_hit_blocks == 9:
            break
        await asyncio.sleep(0.05)
    await nc.drain()
    p0, p1 = disagg.prefills
    assert (p1.worker.prompt_tokens_computed, p1.worker.prompt_tokens_cached) == (0, 0)
    second = await assign_and_read(disagg, assignment(disagg, ids, ["dis-d1"]), prefill="dis-p1")
    # The same prompt again on the worker that computed it: its own prefix cache.
    third = await assign_and_read(disagg, assignment(disagg, ids, ["dis-d0"]), prefill="dis-p0")
    expected = reference_greedy(disagg.model, ids, GREEDY.max_tokens)
    for messages in (first, second, third):
        assert [t for m in messages if isinstance(m, TokenDelta) for t in m.token_ids] == expected
    assert isinstance(first[-1], Finished) and first[-1].usage.cached_tokens == 0
    assert isinstance(second[-1], Finished) and second[-1].usage.cached_tokens == 36
    assert isinstance(third[-1], Finished) and third[-1].usage.cached_tokens == 36
    # The workers' own counters: only the 4 uncached tokens were computed the second time.
    assert (p1.worker.prompt_tokens_computed, p1.worker.prompt_tokens_cached) == (4, 36)
    assert (p0.worker.prompt_tokens_computed, p0.worker.prompt_tokens_cached) == (40 + 4, 36)


@pytest.mark.parametrize("with_cache", [True])
async def test_cache_service_down_still_serves_every_request(disagg: Fleet) -> None:
    await disagg.cache.close(drain_timeout_s=1.0)
    ids = prompts(3)[2]
    async with StraitClient.from_settings(disagg.settings) as client:
        results = await asyncio.gather(*(run(client, "dis", ids) for _ in range(3)))
    expected = reference_greedy(disagg.model, ids, GREEDY.max_tokens)
    assert all(r.token_ids[0] == expected for r in results)
    await assert_idle(disagg)


@pytest.mark.parametrize("with_cache", [True])
async def test_prefill_worker_killed_after_offering_is_replaced(disagg: Fleet) -> None:
    """The prefill worker dies right after offering a request to a decode worker: the decode
    side drops the reservation, the router places the request on the other prefill worker, and
    the client gets the whole, correct answer."""
    s = Subjects(disagg.settings.nats.subject_prefix)
    spy = await nats.connect(disagg.settings.nats.url)
    killed: list[str] = []
    handles = {h.worker_id: h for h in disagg.prefills}

    async def on_offer(msg: nats.aio.msg.Msg) -> None:
        offer = msgspec.json.decode(msg.data, type=HandoffOffer)
        if not killed:
            killed.append(offer.prefill_worker_id)
            await handles[offer.prefill_worker_id].kill()

    for d in disagg.decoders:
        await spy.subscribe(s.handoff_offer(d.worker_id), cb=on_offer)
    ids = prompts(6)[5]
    async with StraitClient.from_settings(disagg.settings) as client:
        c = await run(client, "dis", ids)
    assert c.token_ids[0] == reference_greedy(disagg.model, ids, GREEDY.max_tokens)
    assert len(killed) == 1
    (survivor,) = (h for h in disagg.prefills if h.worker_id != killed[0])
    assert survivor.worker.prompt_tokens_computed + survivor.worker.prompt_tokens_cached == len(ids)
    await spy.drain()
    await asyncio.sleep(disagg.settings.handoff.reservation_ttl_s + 0.5)
    await assert_idle(disagg, skip=killed)


# ---------------------------------------------------------------- helpers


async def assert_idle(f: Fleet, skip: list[str] = ()) -> None:  # type: ignore[assignment]
    """Every live worker is back to its idle state: no request, no reservation, no block in use
    (cached blocks count as free)."""
    for _ in range(50):
        busy = [
            h.worker_id
            for h in f.fleet.workers
            if h.worker_id not in skip and (h.worker.tasks or h.backend.load().kv_blocks_used)
        ]
        if not busy:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not idle: {busy}")


def assignment(f: Fleet, ids: list[int], decode_workers: list[str]) -> Assignment:
    rid = uuid.uuid4().hex
    req = GenerateRequest(request_id=rid, model="dis", prompt_token_ids=ids, sampling=GREEDY)
    route = RouteReason(pool="dis", worker_id="dis-p0", code="explicit_pool")
    return Assignment(request=req, route=route, decode_workers=decode_workers)


async def assign_and_read(
    f: Fleet, a: Assignment, timeout: float = 30.0, prefill: str = "dis-p0"
) -> list[object]:
    """Offer ``a`` to a prefill worker directly (no router) and read its stream to the end."""
    s = Subjects(f.settings.nats.subject_prefix)
    nc = await nats.connect(f.settings.nats.url)
    sub = await nc.subscribe(s.stream(a.request.request_id))
    await nc.request(s.work(prefill), encode(a), timeout=5)
    out: list[object] = []
    while True:
        msg = decode_stream((await sub.next_msg(timeout=timeout)).data)
        out.append(msg)
        if isinstance(msg, (Finished, ErrorMessage)):
            break
    await nc.drain()
    return out


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5)],
    ids=["greedy", "seeded"],
)
async def test_decode_worker_killed_mid_stream_the_request_migrates(
    disagg: Fleet, sampling: dict[str, float]
) -> None:
    """The decode worker streaming a request dies: the router (told by the decode worker that
    it owned the stream) moves the request through the prefill worker — prompt plus the tokens
    streamed so far — to the other decode worker, and the client's answer is unchanged."""
    ids = prompts(4)[3]
    n = 120
    async with StraitClient.from_settings(disagg.settings) as client:
        ref = await client.complete(
            prompt_token_ids=ids, model="agg", max_tokens=n, ignore_eos=True, **sampling
        )
        tokens: list[int] = []
        async with client.generate(
            prompt_token_ids=ids, model="dis", max_tokens=n, ignore_eos=True, **sampling
        ) as gen:
            async for d in gen:
                tokens += d.token_ids
                holders = [h for h in disagg.decoders if gen.request_id in h.worker.tasks]
                if gen.migrations == 0 and len(tokens) >= 5 and holders:
                    await holders[0].kill()
                    killed = holders[0].worker_id
    assert gen.migrations == 1
    assert tokens == ref.token_ids[0]
    assert gen.usage is not None and gen.usage.completion_tokens == n
    assert gen.finished is not None and gen.finished.worker_id not in (killed, "")
    if sampling["temperature"] == 0.0:
        assert tokens == reference_greedy(disagg.model, ids, n)
