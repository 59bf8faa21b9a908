"""StraitClient against a router and FAKE workers on a real nats-server: streaming, cancel,
timeouts, concurrency."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.support.fleet import InProcessFleet, running_fleet
from libs.client import StraitClient, Timeout
from libs.settings import Settings

# Each test runs against the embedded server and, as a team, a secured one (conftest).
pytestmark = [pytest.mark.integration, pytest.mark.nats_modes("embedded", "secured")]


async def wait_until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_generate_streams_deltas_in_order_then_usage(client: StraitClient) -> None:
    async with client.generate("the river runs", max_tokens=6, want_route=True) as gen:
        deltas = [d async for d in gen]
    assert [d.seq for d in deltas] == list(range(2, 8))  # seq 1 is the Routed message
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert gen.usage is not None and gen.usage.completion_tokens == 6
    assert gen.usage.prompt_tokens == 3
    assert gen.route is not None and gen.route.worker_id == "w1"
    assert gen.finished is not None and gen.finished.worker_id == "w1"


async def test_complete_collects_every_choice(client: StraitClient) -> None:
    done = await client.complete(
        messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3, seed=7, stop=["zzz"]
    )
    assert len(done.texts) == 3 and all(len(t.split()) == 4 for t in done.texts)
    assert done.finish_reasons == ["length"] * 3
    assert done.usage.completion_tokens == 12
    again = await client.complete(
        messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3, seed=7
    )
    assert again.texts == done.texts  # seeded sampling is reproducible


async def test_closing_the_iterator_cancels_on_the_worker(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    backend = fleet.workers[0].backend
    backend.settings.per_token_s = 0.05
    async with client.generate("long one", max_tokens=1000) as gen:
        async for _ in gen:
            break
        assert backend.load().running == 1
    await wait_until(lambda: backend.load().running == 0)
    assert gen.finished is None


async def test_break_without_context_manager_also_cancels(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    backend = fleet.workers[0].backend
    backend.settings.per_token_s = 0.05
    got = 0
    async for _ in client.generate("long one", max_tokens=1000):
        got += 1
        if got == 2:
            break
    await wait_until(lambda: backend.load().running == 0)


async def test_task_cancellation_cancels_the_request(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    backend = fleet.workers[0].backend
    backend.settings.per_token_s = 0.05
    task = asyncio.create_task(client.complete("long one", max_tokens=1000))
    await wait_until(lambda: backend.load().running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: backend.load().running == 0)


async def test_first_token_timeout_when_nothing_answers(fleet_settings: Settings) -> None:
    async with running_fleet(fleet_settings, workers=0, router=False) as fleet:
        async with StraitClient.from_settings(fleet.settings) as c:
            t0 = time.perf_counter()
            with pytest.raises(Timeout) as e:
                await c.complete("anyone?", first_token_timeout_s=0.3)
            assert 0.25 < time.perf_counter() - t0 < 2.0
            assert "first_token_timeout_s" in str(e.value) and e.value.code == "timeout"
            assert isinstance(e.value, TimeoutError)


async def test_idle_timeout_mid_stream_cancels_the_worker(fleet_settings: Settings) -> None:
    fleet_settings.fake_engine.per_token_s = 0.5
    async with running_fleet(fleet_settings) as fleet:
        w = fleet.workers[0]
        async with StraitClient.from_settings(fleet.settings) as c:
            gen = c.generate("slow", max_tokens=50, idle_timeout_s=0.15)
            seen = []
            with pytest.raises(Timeout) as e:
                async for d in gen:
                    seen.append(d)
            assert len(seen) == 1 and "idle_timeout_s" in str(e.value)
            await wait_until(lambda: w.backend.load().running == 0)


async def test_200_concurrent_generations_through_one_connection(fleet_settings: Settings) -> None:
    async with running_fleet(fleet_settings, workers=2, capacity=128) as fleet:
        async with StraitClient.from_settings(fleet.settings) as c:

            async def one(i: int) -> tuple[str, int]:
                done = await c.complete(f"prompt number {i}", max_tokens=8, request_id=f"conc-{i}")
                return done.request_id, done.usage.completion_tokens

            tasks = [asyncio.create_task(one(i)) for i in range(200)]
            await asyncio.sleep(0.05)
            # One subscription for every stream (the client's reply mux), none per request;
            # nats-py's own _INBOX one takes the JetStream acks. (_subs: nats-py's live ones.)
            subs = [s.subject for s in c.nc._subs.values() if not s.subject.startswith("_INBOX")]
            assert subs == [c.subjects.reply_streams(c.client_id)]
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            gen = c.generate("which subject", max_tokens=2)
            async with gen:
                assert [d async for d in gen]
            assert gen.request.reply_subject == c.subjects.reply_stream(c.client_id, gen.request_id)
        assert sorted(results) == sorted((f"conc-{i}", 8) for i in range(200))
        assert {w.backend.load().running for w in fleet.workers} == {0}
