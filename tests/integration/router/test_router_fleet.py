"""The router on a real nats-server with FAKE-engine workers: registry, overlap placement,
spread across replicas, re-placement of a lost worker's request, pools and reasons."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import msgspec
import pytest

from bench.support.fleet import InProcessFleet
from libs.backend.fake import FakeBackend
from libs.protocol import (
    ErrorMessage,
    Finished,
    GenerateRequest,
    Routed,
    RouterBeat,
    SamplingParams,
)
from libs.settings import FakeEngineSettings, Settings
from services.router.router import Router
from tests.integration.router.conftest import Client, poll

pytestmark = pytest.mark.integration


def req(
    rid: str, prompt: str, model: str = "auto", max_tokens: int = 4, **kw: object
) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=model,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        **kw,  # type: ignore[arg-type]
    )


def live(router: Router, pool: str = "default") -> set[str]:
    return {w.worker_id for w in router.registry.live(pool)}


async def test_beats_build_the_registry_and_a_silent_worker_is_dropped(
    router_settings: Settings,
) -> None:
    async with InProcessFleet(router_settings) as fleet:
        for w in ("w1", "w2", "w3"):
            await fleet.add_worker(w)
        await poll(lambda: len(fleet.routers) == 1, what="router start")
        router = fleet.routers[0]
        await poll(lambda: live(router) == {"w1", "w2", "w3"}, what="three live workers")
        await fleet.workers[1].kill()
        took = await poll(lambda: "w2" not in router.registry.workers, what="w2 expired")
        assert took < router_settings.fleet.worker_ttl_s + 0.5
        assert live(router) == {"w1", "w3"}


async def test_a_long_shared_prefix_goes_to_the_worker_that_holds_it(
    router_settings: Settings, client: Client
) -> None:
    prefix = " ".join(f"doc{i}" for i in range(320))  # 20 blocks of 16 words
    async with InProcessFleet(router_settings) as fleet:
        for i in range(4):
            await fleet.add_worker(f"w{i}")
        await poll(lambda: bool(fleet.routers) and len(live(fleet.routers[0])) == 4)
        first = await client.run(req("p0", prefix + " question zero"))
        holder = first[-1].worker_id  # type: ignore[union-attr]
        registry = fleet.routers[0].registry
        await poll(lambda: any(holder in held for held in registry.holders.values()))
        for i in range(1, 7):
            out = await client.run(req(f"p{i}", f"{prefix} another question {i}", want_route=True))
            routed, done = out[0], out[-1]
            assert isinstance(routed, Routed) and isinstance(done, Finished)
            assert routed.route.worker_id == holder and routed.route.overlap_blocks == 20
            assert done.usage.cached_tokens == 320


async def test_equal_load_is_spread_without_herding_by_two_router_replicas(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.01
    async with InProcessFleet(router_settings) as fleet:
        await fleet.add_router()
        for i in range(4):
            await fleet.add_worker(f"w{i}")
        await poll(
            lambda: len(fleet.routers) == 2 and all(len(live(r)) == 4 for r in fleet.routers)
        )
        n = 64
        outs = await asyncio.gather(
            *(
                client.run(req(f"s{i}", f"unrelated prompt number {i}", max_tokens=30))
                for i in range(n)
            )
        )
        assert all(isinstance(o[-1], Finished) for o in outs)
        await poll(lambda: len(client.decisions) == n, what="all route decisions")
        per_worker = Counter(d.route.worker_id for d in client.decisions)
        assert set(per_worker) == {"w0", "w1", "w2", "w3"}
        # A fair share is n/4 = 16; herding (every concurrent decision picking the worker that
        # looked idlest in the last beat) gives one worker 30-40.
        assert max(per_worker.values()) <= 3 * n // 8, per_worker
        assert min(per_worker.values()) >= n // 8, per_worker


async def test_a_worker_killed_before_its_first_token_the_request_completes_on_another(
    router_settings: Settings, client: Client
) -> None:
    slow = FakeBackend(FakeEngineSettings(per_prompt_token_s=1.0), model_name="fake-model")
    async with InProcessFleet(router_settings) as fleet:
        doomed = await fleet.add_worker("doomed", backend=slow)
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"doomed"})
        run = asyncio.create_task(
            client.run(req("r1", "a prompt that takes long", want_route=True))
        )
        await poll(lambda: "r1" in doomed.worker.tasks, what="assignment on the doomed worker")
        await fleet.add_worker("rescuer")
        await poll(lambda: "rescuer" in live(fleet.routers[0]))
        await doomed.kill()
        out = await asyncio.wait_for(run, 10)
        done = out[-1]
        assert isinstance(done, Finished) and done.worker_id == "rescuer", out
        await poll(lambda: len(client.decision("r1")) == 2, what="the second decision")
        first, second = client.decision("r1")
        assert first.route.worker_id == "doomed" and second.route.worker_id == "rescuer"
        assert second.route.code == "replaced" and "worker_lost:doomed" in second.route.factors
        assert fleet.routers[0].watch.watched == {}


async def test_a_mixed_workload_uses_both_pools_and_records_why(
    two_pool_settings: Settings, client: Client
) -> None:
    from tests.integration.router.conftest import LARGE, SMALL

    async with InProcessFleet(two_pool_settings) as fleet:
        for pool, model in (("small", SMALL), ("large", LARGE)):
            for i in range(2):
                await fleet.add_worker(f"{pool}{i}", pool=pool, model=model)
        await poll(lambda: bool(fleet.routers) and len(live(fleet.routers[0], "large")) == 2)
        await poll(lambda: len(live(fleet.routers[0], "small")) == 2)
        easy = [req(f"e{i}", f"What is the capital of country {i}?") for i in range(6)]
        hard = [
            req(f"h{i}", f"Prove step by step that sum {i} * 2 is even", max_tokens=600)
            for i in range(3)
        ] + [
            req(f"c{i}", f"```python\ndef f{i}(x):\n    return x\n```\nExplain why", max_tokens=8)
            for i in range(3)
        ]
        outs = await asyncio.gather(*(client.run(r) for r in easy + hard))
        finished = {o[-1].request_id: o[-1] for o in outs if isinstance(o[-1], Finished)}
        assert len(finished) == 12
        # The events stream holds every decision with its reason.
        sub = await client.js.pull_subscribe(client.subjects.event("route"), durable=None)
        events = []
        while len(events) < 12:
            events += await sub.fetch(12 - len(events), timeout=5)
        import msgspec

        from libs.protocol import RouteDecision

        decisions = {
            d.request_id: d
            for d in (msgspec.json.decode(m.data, type=RouteDecision) for m in events)
        }
        for r in easy:
            d = decisions[r.request_id].route
            assert (d.pool, d.code, d.score) == ("small", "auto_small", 0.0)
            assert finished[r.request_id].pool == "small"  # type: ignore[attr-defined]
        for r in hard:
            d = decisions[r.request_id].route
            assert (d.pool, d.code) == ("large", "auto_large")
            assert d.score is not None and d.score >= two_pool_settings.router.large_threshold
            assert {"math", "code"} & set(d.factors)
            assert finished[r.request_id].pool == "large"  # type: ignore[attr-defined]


async def test_no_live_worker_is_a_clear_503_with_retry_after(
    two_pool_settings: Settings, client: Client
) -> None:
    from tests.integration.router.conftest import SMALL

    async with InProcessFleet(two_pool_settings) as fleet:
        await fleet.add_worker("small0", pool="small", model=SMALL)
        await poll(lambda: bool(fleet.routers) and len(live(fleet.routers[0], "small")) == 1)
        out = await client.run(req("x1", "hello", model="large"))
        err = out[-1]
        assert isinstance(err, ErrorMessage) and err.code == "no_worker"
        assert err.retry_after_s == two_pool_settings.fleet.retry_after_s
        # `auto` work for the missing pool spills to the live one, and says so.
        out = await client.run(req("x2", "Prove step by step that 2 * 3 is even", max_tokens=600))
        assert isinstance(out[-1], Finished) and out[-1].pool == "small"
        await poll(lambda: bool(client.decision("x2")))
        route = client.decision("x2")[0].route
        assert route.code == "spill_over" and "no_live_worker:large" in route.factors


async def test_requests_held_while_the_pool_is_full_go_to_a_worker_that_starts(
    router_settings: Settings, client: Client
) -> None:
    """Late binding (decision 0026): one worker of 2 slots, no queue allowance; 8 requests sent
    at once. Two run, six are held in the router (none queue in the worker), its beat says so,
    and a worker that starts takes held requests at once; every request completes."""
    router_settings.router.hold_queue_per_worker = 0
    router_settings.router.beat_interval_s = 0.05
    router_settings.fake_engine.per_token_s = 0.05
    beats: list[RouterBeat] = []

    async def on_beat(msg: Any) -> None:
        beats.append(msgspec.json.decode(msg.data, type=RouterBeat))

    await client.nc.subscribe(client.subjects.router_beats_all, cb=on_beat)
    async with InProcessFleet(router_settings) as fleet:
        await fleet.add_worker("w0", backend=FakeBackend(router_settings.fake_engine, capacity=2))
        await poll(lambda: len(fleet.routers) == 1 and live(fleet.routers[0]) == {"w0"})
        (router,) = fleet.routers
        runs = [
            asyncio.create_task(client.run(req(f"h{i}", f"prompt {i}", max_tokens=30), 30.0))
            for i in range(8)
        ]
        await poll(lambda: len(router.held.get("default", ())) == 6, what="six held")
        await poll(lambda: any(b.held.get("default") == 6 for b in beats), what="a router beat")
        assert {d.route.worker_id for d in client.decisions} == {"w0"}
        assert len(client.decisions) == 2
        await fleet.add_worker("w1", backend=FakeBackend(router_settings.fake_engine, capacity=2))
        # Within a beat or two of w1's first, two held requests go to it (w0 still runs 1.5 s).
        await poll(
            lambda: sum(d.route.worker_id == "w1" for d in client.decisions) == 2,
            timeout=1.0,
            what="held requests placed on the new worker",
        )
        outs = await asyncio.gather(*runs)
        assert all(isinstance(o[-1], Finished) for o in outs)
        assert router.held["default"] == []


async def test_a_request_offered_to_a_worker_that_just_died_waits_for_its_restart(
    router_settings: Settings, client: Client
) -> None:
    """kill -9 of the only worker, and a request sent before its beats have expired: the offer
    goes unanswered; instead of no_capacity, the router decides again one TTL later, finds
    the pool's worker lost without draining, and waits for it (issue 43)."""
    async with InProcessFleet(router_settings) as fleet:
        w0 = await fleet.add_worker("w0")
        await poll(lambda: len(fleet.routers) == 1 and live(fleet.routers[0]) == {"w0"})
        await w0.kill()  # no beat, no reply: the registry still has it for a TTL
        run = asyncio.create_task(client.run(req("dead", "hello there", max_tokens=4), 20.0))
        await asyncio.sleep(router_settings.router.assign_timeout_s + 0.5)
        await fleet.add_worker("w0")  # the supervisor's restart
        out = await run
        assert isinstance(out[-1], Finished), out
        (d,) = client.decision("dead")
        assert d.route.worker_id == "w0"
