"""Migration on a real nats-server with FAKE-engine workers: a worker lost mid-stream, and the
stream goes on from another worker — no gap, no repeated token, seq counting on, usage counted
once — or ends with a typed error within a few beat intervals when it cannot move."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.support.fleet import InProcessFleet, WorkerHandle
from libs.backend.fake import FakeBackend
from libs.protocol import (
    CancelRequest,
    ErrorMessage,
    Finished,
    GenerateRequest,
    Migrated,
    SamplingParams,
    StreamMessage,
    TokenDelta,
    encode,
)
from libs.settings import FakeEngineSettings, Settings
from libs.wire.stream_reader import StreamReader
from services.router.router import Router
from tests.integration.router.conftest import Client, poll

pytestmark = pytest.mark.integration

PROMPT = "tell me about the rivers and the bridges"


def req(rid: str, max_tokens: int = 60, n: int = 1, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, n=n, seed=seed, ignore_eos=True),
    )


def live(router: Router) -> set[str]:
    return {w.worker_id for w in router.registry.live("default")}


async def reference_text(settings: Settings, r: GenerateRequest) -> str:
    """What an uninterrupted fake worker streams for ``r`` (choice 0)."""
    backend = FakeBackend(settings.fake_engine.model_copy(update={"per_token_s": 0.0}))
    prompt = backend.prepare(
        prompt=r.prompt, prompt_token_ids=None, messages=None, sampling=r.sampling
    )
    text = ""
    async for c in backend.generate(r.request_id, prompt, r.sampling, "interactive"):
        if c.index == 0:
            text += c.text
    return text


async def read_until_kill(
    client: Client,
    r: GenerateRequest,
    kill_after_deltas: int,
    holder: dict[str, WorkerHandle],
    timeout: float = 15.0,
) -> tuple[list[StreamMessage], list[float], float]:
    """Publish ``r``, read its stream; after ``kill_after_deltas`` deltas kill the worker that
    holds it. Returns the messages, their arrival times and the kill time (monotonic)."""
    got: list[StreamMessage] = []
    at: list[float] = []
    killed_at = 0.0
    async with StreamReader(
        client.nc, client.subjects.stream(r.request_id), timeout, timeout
    ) as reader:
        await client.js.publish(client.subjects.requests, encode(r))
        async for m in reader.messages():
            got.append(m)
            at.append(time.monotonic())
            deltas = sum(isinstance(x, TokenDelta) for x in got)
            if not killed_at and deltas == kill_after_deltas:
                victim = next(h for h in holder.values() if r.request_id in h.worker.tasks)
                await victim.kill()
                killed_at = time.monotonic()
    return got, at, killed_at


async def test_a_worker_lost_mid_stream_the_stream_goes_on_from_another(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    r = req("m1", max_tokens=60)
    async with InProcessFleet(router_settings) as fleet:
        workers = {w: await fleet.add_worker(w) for w in ("w1", "w2")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1", "w2"})
        got, at, killed_at = await read_until_kill(client, r, 10, workers)
        router = fleet.routers[0]
        await poll(lambda: router.watch.watched == {}, what="the watch to end")

    deltas = [m for m in got if isinstance(m, TokenDelta)]
    markers = [m for m in got if isinstance(m, Migrated)]
    end = got[-1]
    assert isinstance(end, Finished), got[-1]
    assert [m.seq for m in got] == list(range(1, len(got) + 1))  # no gap, no duplicate
    assert len(markers) == 1 and markers[0].num_tokens == 10 and markers[0].attempt == 2
    assert "".join(d.text for d in deltas) == await reference_text(router_settings, r)
    assert sum(len(d.token_ids) for d in deltas) == 60
    assert end.usage.completion_tokens == 60  # the lost worker's tokens counted once
    survivor = end.worker_id
    assert survivor != markers[0].from_worker
    # The first token after the kill: within a beat TTL, a sweep and a placement (≤ 2 s).
    after = next(
        t for m, t in zip(got, at, strict=True) if isinstance(m, TokenDelta) and t > killed_at
    )
    assert after - killed_at < 2.0
    decisions = client.decision("m1")
    await poll(lambda: len(client.decision("m1")) == 2, what="the second decision")
    decisions = client.decision("m1")
    assert decisions[1].route.code == "migrated"
    assert decisions[1].route.worker_id == survivor


async def test_seeded_sampling_continues_by_position(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    r = req("m2", max_tokens=30, seed=1234)
    async with InProcessFleet(router_settings) as fleet:
        workers = {w: await fleet.add_worker(w) for w in ("w1", "w2")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1", "w2"})
        got, _, _ = await read_until_kill(client, r, 5, workers)
    text = "".join(m.text for m in got if isinstance(m, TokenDelta))
    assert isinstance(got[-1], Finished)
    assert text == await reference_text(router_settings, r)


async def test_no_worker_left_is_a_typed_error_within_a_ttl(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    router_settings.router.worker_return_wait_s = 0.0  # no wait for a worker to come back
    r = req("m3", max_tokens=200)
    async with InProcessFleet(router_settings) as fleet:
        workers = {"only": await fleet.add_worker("only")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"only"})
        got, at, killed_at = await read_until_kill(client, r, 3, workers)
    end = got[-1]
    assert isinstance(end, ErrorMessage) and end.code == "worker_lost", end
    assert "no live worker" in end.message
    assert [m.seq for m in got] == list(range(1, len(got) + 1))
    ttl = router_settings.fleet.worker_ttl_s
    assert at[-1] - killed_at < ttl + 1.0  # not the client's idle timeout


async def test_a_lone_worker_lost_mid_stream_the_stream_waits_and_resumes_on_its_restart(
    router_settings: Settings, client: Client
) -> None:
    """The pool's only worker is killed mid-stream and restarted (same id, as `strait up`
    does) 1.5 s later: the stream pauses with one Migrated marker saying why
    (``waiting_for_worker``) and goes on from the restarted worker, with exactly the text of an
    uninterrupted run."""
    router_settings.fake_engine.per_token_s = 0.02
    r = req("m5", max_tokens=60)
    async with InProcessFleet(router_settings) as fleet:
        workers = {"only": await fleet.add_worker("only")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"only"})

        async def restart() -> None:
            await poll(lambda: not workers["only"].nc.is_connected, what="the kill")
            await asyncio.sleep(1.5)
            await fleet.add_worker("only")

        restarting = asyncio.create_task(restart())
        got, at, killed_at = await read_until_kill(client, r, 10, workers)
        await restarting
    deltas = [m for m in got if isinstance(m, TokenDelta)]
    markers = [m for m in got if isinstance(m, Migrated)]
    assert isinstance(got[-1], Finished), got[-1]
    assert [m.seq for m in got] == list(range(1, len(got) + 1))
    assert [(m.reason, m.num_tokens) for m in markers] == [("waiting_for_worker", 10)]
    assert "".join(d.text for d in deltas) == await reference_text(router_settings, r)
    assert got[-1].usage.completion_tokens == 60
    resumed = next(
        t for m, t in zip(got, at, strict=True) if isinstance(m, TokenDelta) and t > killed_at
    )
    assert 1.5 < resumed - killed_at < 1.5 + 2.0  # the restart, then a beat and a placement


async def test_a_lost_worker_that_does_not_come_back_ends_the_stream_after_the_wait(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    router_settings.router.worker_return_wait_s = 1.0
    r = req("m6", max_tokens=200)
    async with InProcessFleet(router_settings) as fleet:
        workers = {"only": await fleet.add_worker("only")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"only"})
        got, at, killed_at = await read_until_kill(client, r, 3, workers)
    end = got[-1]
    assert isinstance(end, ErrorMessage) and end.code == "worker_lost", end
    assert "router.worker_return_wait_s" in end.message
    assert [m.reason for m in got if isinstance(m, Migrated)] == ["waiting_for_worker"]
    ttl = router_settings.fleet.worker_ttl_s
    assert 1.0 + ttl < at[-1] - killed_at < ttl + 1.0 + 1.0


async def test_requests_sent_while_the_lone_worker_restarts_wait_and_are_served(
    router_settings: Settings, client: Client
) -> None:
    """Requests for a pool whose only worker was lost (and is restarting) stay queued instead
    of a 503 no_worker, and are all served once it beats again."""
    async with InProcessFleet(router_settings) as fleet:
        only = await fleet.add_worker("only")
        router = await _router(fleet)
        await poll(lambda: live(router) == {"only"})
        await only.kill()
        await poll(lambda: not live(router), what="the worker to expire")
        sent = [req(f"q{i}", max_tokens=5) for i in range(6)]
        runs = [asyncio.create_task(client.run(r)) for r in sent]
        await poll(lambda: router.waiting.get("default", 0) == len(sent), what="the wait")
        await fleet.add_worker("only")
        outs = await asyncio.gather(*runs)
    assert [type(o[-1]).__name__ for o in outs] == ["Finished"] * len(sent)
    assert router.waiting == {"default": 0}


async def _router(fleet: InProcessFleet) -> Router:
    await poll(lambda: bool(fleet.routers), what="the router")
    return fleet.routers[0]


async def test_n_greater_than_one_mid_stream_ends_with_worker_lost(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    r = req("m4", max_tokens=100, n=2)
    async with InProcessFleet(router_settings) as fleet:
        workers = {w: await fleet.add_worker(w) for w in ("w1", "w2")}
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1", "w2"})
        got, _, _ = await read_until_kill(client, r, 6, workers)
    end = got[-1]
    assert isinstance(end, ErrorMessage) and end.code == "worker_lost", end
    assert "n > 1" in end.message
    assert [m.seq for m in got] == list(range(1, len(got) + 1))


async def test_a_stalled_worker_that_comes_back_does_not_resume_the_stream(
    router_settings: Settings, client: Client
) -> None:
    """A worker that stops beating (a stalled event loop, a SIGSTOP) is presumed lost: past the
    router's TTL it stops writing to its streams itself (and the router's targeted cancel stops
    it too), and the request's new worker keeps the stream."""
    router_settings.fake_engine.per_token_s = 0.02
    r = req("m5", max_tokens=60)
    async with InProcessFleet(router_settings) as fleet:
        w1 = await fleet.add_worker("w1")
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1"})
        async with StreamReader(client.nc, client.subjects.stream("m5"), 10, 10) as reader:
            await client.js.publish(client.subjects.requests, encode(r))
            messages = reader.messages()
            first = await anext(messages)
            assert isinstance(first, TokenDelta)
            await fleet.add_worker("w2")
            await poll(lambda: "w2" in live(fleet.routers[0]))
            w1.beats.cancel()  # silent, but still connected and streaming
            rest = [m async for m in messages]
        await poll(lambda: "m5" not in w1.worker.tasks, what="the stalled worker to drop it")
    end = rest[-1]
    assert isinstance(end, Finished) and end.worker_id == "w2", end
    text = "".join(m.text for m in [first, *rest] if isinstance(m, TokenDelta))
    assert text == await reference_text(router_settings, r)


@pytest.mark.parametrize("max_tokens", [10, 80])
async def test_a_draining_worker_finishes_or_hands_over(
    router_settings: Settings, client: Client, max_tokens: int
) -> None:
    """SIGTERM's drain: no new work; what finishes within the deadline finishes here, the rest
    migrates once the beats stop (what ``services.worker.process.run_worker`` does)."""
    router_settings.fake_engine.per_token_s = 0.02
    r = req(f"d{max_tokens}", max_tokens=max_tokens)
    async with InProcessFleet(router_settings) as fleet:
        w1 = await fleet.add_worker("w1")
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1"})
        async with StreamReader(client.nc, client.subjects.stream(r.request_id), 10, 10) as rd:
            await client.js.publish(client.subjects.requests, encode(r))
            messages = rd.messages()
            got = [await anext(messages)]
            await fleet.add_worker("w2")
            await poll(lambda: "w2" in live(fleet.routers[0]))
            await w1.worker.drain(0.5)
            w1.beats.cancel()
            assert w1.worker.tasks == {}
            got += [m async for m in messages]
    end = got[-1]
    moved = [m for m in got if isinstance(m, Migrated)]
    assert isinstance(end, Finished), end
    assert end.worker_id == ("w1" if max_tokens == 10 else "w2")
    assert len(moved) == (0 if max_tokens == 10 else 1)
    text = "".join(m.text for m in got if isinstance(m, TokenDelta))
    assert text == await reference_text(router_settings, r)
    assert end.usage.completion_tokens == max_tokens


class WedgedBackend(FakeBackend):
    """Streams a few tokens, then hangs (a stuck engine) while the worker keeps beating."""

    def __init__(self, settings: FakeEngineSettings, after: int) -> None:
        super().__init__(settings, model_name="fake-model")
        self.after = after

    async def generate(self, request_id, prompt, sampling, priority, resume=None, tenant=None):  # type: ignore[no-untyped-def, override]
        n = 0
        async for chunk in super().generate(request_id, prompt, sampling, priority, resume):
            yield chunk
            n += 1
            if n == self.after:
                await asyncio.Event().wait()


async def test_a_stream_stalled_on_a_beating_worker_moves(
    router_settings: Settings, client: Client
) -> None:
    router_settings.fake_engine.per_token_s = 0.02
    router_settings.router.stall_timeout_s = 0.5
    r = req("s1", max_tokens=40)
    async with InProcessFleet(router_settings) as fleet:
        await fleet.add_worker("stuck", backend=WedgedBackend(router_settings.fake_engine, 5))
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"stuck"})
        async with StreamReader(client.nc, client.subjects.stream("s1"), 10, 10) as reader:
            await client.js.publish(client.subjects.requests, encode(r))
            messages = reader.messages()
            first = await anext(messages)
            await fleet.add_worker("w2")
            await poll(lambda: "w2" in live(fleet.routers[0]))
            got = [first, *[m async for m in messages]]
        stuck = fleet.workers[0]
        await poll(lambda: "s1" not in stuck.worker.tasks, what="the stuck worker to drop it")
    end = got[-1]
    moved = [m for m in got if isinstance(m, Migrated)]
    assert isinstance(end, Finished) and end.worker_id == "w2", end
    assert len(moved) == 1 and moved[0].reason == "stalled"
    text = "".join(m.text for m in got if isinstance(m, TokenDelta))
    assert text == await reference_text(router_settings, r)


async def test_a_cancelled_stream_is_no_longer_watched(
    router_settings: Settings, client: Client
) -> None:
    """A client's cancel ends the stream with no last message: the router stops watching it,
    so a stall or a later worker loss never moves a request nobody reads."""
    router_settings.fake_engine.per_token_s = 0.02
    r = req("c1", max_tokens=200)
    async with InProcessFleet(router_settings) as fleet:
        await fleet.add_worker("w1")
        await poll(lambda: bool(fleet.routers) and live(fleet.routers[0]) == {"w1"})
        async with StreamReader(client.nc, client.subjects.stream("c1"), 10, 10) as reader:
            await client.js.publish(client.subjects.requests, encode(r))
            messages = reader.messages()
            await anext(messages)
            assert "c1" in fleet.routers[0].watch.watched
            await client.nc.publish(
                client.subjects.cancel("c1"), encode(CancelRequest(request_id="c1"))
            )
            await poll(lambda: "c1" not in fleet.routers[0].watch.watched, what="unwatched")
            await poll(lambda: "c1" not in fleet.workers[0].worker.tasks, what="cancelled")
