"""Router.decide across regions: local first, the crossing cost, the recorded reason, the
prefix held in another region, and the subjects and streams of a region."""

from __future__ import annotations

import random
import time

import pytest

from libs.backend.fake import FakeBackend
from libs.protocol import SamplingParams, Subjects
from libs.registry import WorkerRegistry
from libs.settings import FakeEngineSettings, NatsSettings, PoolSettings, Settings
from libs.wire.nats_util import ledger_stream_config, stream_configs
from services.router.router import Decision, Rejection, Router
from tests.unit.router.helpers import beat, hold, registry, request

pytestmark = pytest.mark.unit

MODEL = "smollm2-135m-instruct"


def settings(region: str = "a", **router: object) -> Settings:
    s = Settings()
    s.pools = [PoolSettings(name="default", model=MODEL, backend="fake")]
    s.nats.region = region
    for k, v in router.items():
        setattr(s.router, k, v)
    return s


def decided(s: Settings, reg: WorkerRegistry, **kw: object) -> Decision:
    r = Router(None, None, s, reg, rng=random.Random(0))  # type: ignore[arg-type]
    d = r.decide(request("hi", model="default"), **kw)  # type: ignore[arg-type]
    assert isinstance(d, Decision), d
    return d


def two_regions(a_running: int = 0, b_running: int = 0, capacity: int = 10) -> WorkerRegistry:
    return registry(
        beat("a1", model=MODEL, region="a", running=a_running, capacity=capacity),
        beat("b1", model=MODEL, region="b", running=b_running, capacity=capacity),
        beat("b2", model=MODEL, region="b", running=b_running, capacity=capacity),
    )


def test_a_request_stays_in_its_region_even_when_the_other_is_idler() -> None:
    d = decided(settings("a"), two_regions(a_running=8))
    first = d.route(d.ranked[0])
    assert (first.worker_id, first.region, first.cross_region) == ("a1", "a", "")
    assert d.cross == ""
    # The other region's workers follow as fallbacks (a local worker dead inside its TTL),
    # and say so when taken.
    assert [p.worker.worker_id for p in d.ranked[1:]] and all(
        p.worker.beat.region == "b" for p in d.ranked[1:]
    )
    fallback = d.route(d.ranked[1])
    assert fallback.cross_region == "local_unanswered"
    assert "cross_region=1.000" in fallback.factors


def test_no_local_worker_goes_to_the_other_region_with_the_reason() -> None:
    d = decided(settings("a"), two_regions(), exclude=frozenset({"a1"}))
    route = d.route(d.ranked[0])
    assert route.region == "b" and route.cross_region == "no_local_worker"
    p = d.ranked[0]
    assert p.region_cost == 1.0 and p.cost == pytest.approx(1.0 + p.prefill_cost + p.load_cost)


def test_a_saturated_region_crosses_only_when_the_crossing_is_worth_it() -> None:
    # a1 full (load 1.0), b idle: 1.0 + 0 crossing 0.5 → b.
    s = settings("a", cross_region_cost=0.5)
    d = decided(s, two_regions(a_running=10))
    assert d.ranked[0].worker.beat.region == "b" and d.cross == "local_saturated"
    # The same with a crossing dearer than the local worker's queue: stays in a.
    s = settings("a", cross_region_cost=3.0)
    d = decided(s, two_regions(a_running=12, b_running=0))
    assert d.ranked[0].worker.worker_id == "a1"
    assert d.route(d.ranked[0]).cross_region == ""


def test_the_nearest_region_wins_by_its_crossing_cost() -> None:
    reg = registry(
        beat("b1", model=MODEL, region="b"),
        beat("c1", model=MODEL, region="c"),
    )
    near_c = decided(settings("a", region_costs={"c": 0.2}), reg)
    assert near_c.ranked[0].worker.worker_id == "c1"
    near_b = decided(settings("a", region_costs={"b": 0.2}), reg)
    assert near_b.ranked[0].worker.worker_id == "b1"


def test_blocks_held_in_another_region_do_not_pull_the_request_there() -> None:
    s = settings("a")
    reg = registry(
        beat("a1", model=MODEL, region="a", block_size=16),
        beat("b1", model=MODEL, region="b", block_size=16),
    )
    prompt = " ".join(f"w{i}" for i in range(200))
    fake = FakeBackend(FakeEngineSettings(), model_name=MODEL, block_size=16)
    ids = fake.prepare(
        prompt=prompt, prompt_token_ids=None, messages=None, sampling=SamplingParams()
    )
    hold(reg, "b1", fake.block_hashes(ids.token_ids))
    r = Router(None, None, s, reg, rng=random.Random(0))  # type: ignore[arg-type]
    d = r.decide(request(prompt + " and a new question", model="default"))
    assert isinstance(d, Decision)
    assert d.ranked[0].worker.worker_id == "a1" and d.ranked[0].overlap_blocks == 0
    # The B worker's own blocks still count for it (a real saving there).
    assert d.ranked[1].worker.worker_id == "b1" and d.ranked[1].overlap_blocks > 0


def test_without_regions_every_worker_is_local() -> None:
    d = decided(settings(""), two_regions(a_running=9))
    assert {p.worker.worker_id for p in d.ranked[:2]} == {"b1", "b2"}  # least loaded
    assert all(d.route(p).cross_region == "" for p in d.ranked)


def test_no_worker_in_any_region_is_no_worker() -> None:
    r = Router(None, None, settings("a"), registry(), rng=random.Random(0))  # type: ignore[arg-type]
    rej = r.decide(request("hi", model="default"))
    assert isinstance(rej, Rejection) and rej.code == "no_worker"


def test_a_regions_subjects_and_streams_are_its_own() -> None:
    n = NatsSettings(region="b", regions=["a", "b"])
    sub = Subjects.of(n)
    assert sub.requests == "strait.v1.region.b.requests"
    assert sub.event("usage") == "strait.v1.region.b.events.usage"
    assert sub.cache_lookup == "strait.v1.region.b.cache.lookup"
    # What crosses the gateways keeps one name.
    assert sub.beat("p", "aggregated", "w") == Subjects().beat("p", "aggregated", "w")
    assert sub.stream("r") == Subjects().stream("r") and sub.work("w") == Subjects().work("w")
    names = {c.name: c for c in stream_configs(n)}
    assert set(names) == {"STRAIT_REQUESTS-b", "STRAIT_EVENTS-b", "STRAIT_CACHE_EVENTS-b"}
    assert all(c.placement is not None and c.placement.cluster == "b" for c in names.values())
    ledger = ledger_stream_config(n)
    assert ledger.name == "STRAIT_EVENTS" and not ledger.subjects
    assert ledger.placement is not None and ledger.placement.cluster == "a"
    assert [src.name for src in ledger.sources or []] == ["STRAIT_EVENTS-a", "STRAIT_EVENTS-b"]
    t = (ledger.sources or [])[1].subject_transforms or []
    assert (t[0].src, t[0].dest) == ("strait.v1.region.b.events.>", "strait.v1.events.>")


def test_one_region_keeps_every_name() -> None:
    n = NatsSettings()
    assert Subjects.of(n).requests == "strait.v1.requests"
    names = [c.name for c in stream_configs(n)]
    assert names == ["STRAIT_REQUESTS", "STRAIT_EVENTS", "STRAIT_CACHE_EVENTS"]
    assert all(c.placement is None for c in stream_configs(n))
    assert ledger_stream_config(n).subjects == ["strait.v1.events.>"]


async def test_workers_found_after_a_wait_get_a_recheck_when_they_do_not_answer() -> None:
    """A stream waited for a worker (its region's link was cut); the workers that come back
    do not answer the first offers (no route to them yet): the router tries them again one
    TTL later instead of ending the request with no_capacity."""
    import asyncio

    import msgspec
    from nats.errors import NoRespondersError

    from libs.protocol import AssignmentAck

    s = settings("a")
    s.fleet.worker_ttl_s = 0.05
    s.fleet.replace_lost = False  # no stream watch (no NATS here)
    s.router.sweep_interval_s = 0.01
    s.router.worker_return_wait_s = 5.0
    reg = WorkerRegistry(s.fleet.worker_ttl_s, s.router.worker_return_wait_s)
    reg.lost["b1"] = ("default", time.monotonic())  # lost without draining: coming back
    answers = [NoRespondersError()]
    published: list[bytes] = []

    class FakeNats:
        async def request(self, *a: object, **kw: object) -> object:
            if answers:
                raise answers.pop(0)
            return type("Reply", (), {"data": msgspec.json.encode(AssignmentAck(accepted=True))})

        async def publish(self, subject: str, data: bytes, **kw: object) -> None:
            published.append(data)

    class FakeJs:
        async def publish(self, *a: object, **kw: object) -> None:
            return None

    r = Router(FakeNats(), FakeJs(), s, reg, rng=random.Random(0))  # type: ignore[arg-type]

    async def come_back() -> None:
        await asyncio.sleep(0.1)
        for _ in range(40):  # beats every 10 ms for a while
            reg.on_beat(beat("b1", model=MODEL, region="b"))
            await asyncio.sleep(0.01)

    back = asyncio.create_task(come_back())
    route = await r.place(request("hi", model="default"), attempt=2, recheck=True)
    await back
    assert route is not None and route.worker_id == "b1" and route.cross_region
    assert answers == [] and published == []  # no error on the stream
