"""Router.hold_while_full: late binding on hand-built registries (no NATS).

A new request waits in the router while every worker of its pool holds its capacity plus
``router.hold_queue_per_worker``, and goes in arrival order as room appears; a worker that
starts meanwhile takes the held requests.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from libs.settings import Settings
from services.router.decision import Decision, Rejection
from services.router.router import Router
from tests.unit.router.helpers import beat, registry, request

pytestmark = pytest.mark.unit


def settings(limit: int = 0, hold_max_s: float = 30.0, max_pool_queue: int = 512) -> Settings:
    s = Settings()
    s.router.hold_queue_per_worker = limit
    s.router.hold_max_s = hold_max_s
    s.router.sweep_interval_s = 0.01
    s.router.max_pool_queue = max_pool_queue
    s.flow.min_in_flight = 0  # one tenant here: its first request waits too (test_flow_holds)
    return s


def router(s: Settings, *beats: object) -> Router:
    return Router(None, None, s, registry(*beats), rng=random.Random(0))  # type: ignore[arg-type]


async def until(pred: object, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.005)


def test_room_is_capacity_plus_the_queue_allowance_less_what_each_worker_holds() -> None:
    r = router(
        settings(limit=2),
        beat("w1", running=4, waiting=1, capacity=4),  # 4 + 2 - 5 = 1
        beat("w2", running=6, waiting=3, capacity=4),  # over: 0, never negative
    )
    assert r.room("default") == 1
    r.registry.on_assigned("w1")
    assert r.room("default") == 0
    assert router(settings(), beat("w1", pool="other")).room("default") > 10**9  # no worker


async def test_a_full_pool_holds_requests_and_lets_the_oldest_go_first() -> None:
    r = router(settings(), beat("w1", running=2, capacity=2))
    order: list[str] = []

    async def arrive(rid: str) -> None:
        await r.hold_while_full(request("hi", rid=rid))
        order.append(rid)
        r.registry.on_assigned("w1")  # what ``place`` does next, before any await

    tasks = []
    for rid in ("a", "b", "c"):
        tasks.append(asyncio.create_task(arrive(rid)))
        await asyncio.sleep(0.02)
    assert order == [] and len(r.held["default"]) == 3
    first = r.beat("router-1")
    assert first.held == {"default": 3} and first.held_arrivals == {"default": 3}
    assert r.beat("router-1").held_arrivals == {}  # counted once, by the beat after them
    assert r.beat("router-1").oldest_held_s["default"] > 0
    assert r.beat("router-1").held == {"default": 3}
    d = r.decide(request("hi", rid="d"))  # held requests count as queued
    assert isinstance(d, Decision)
    # Two slots free up (the beat after two requests finished): the two oldest go, in order.
    r.registry.on_beat(beat("w1", running=0, capacity=2))
    await until(lambda: len(order) == 2)
    await asyncio.sleep(0.05)  # several sweeps: the third stays held
    # The two oldest go (in the same sweep, so in either order); the newest stays held.
    assert sorted(order) == ["a", "b"] and len(r.held["default"]) == 1
    # A worker that starts takes the one still held.
    r.registry.on_beat(beat("w2", capacity=2))
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert order[2] == "c" and r.held["default"] == []
    assert r.beat("router-1").held == {}


async def test_room_lets_a_request_through_without_waiting() -> None:
    r = router(settings(limit=1), beat("w1", running=2, capacity=2))
    await asyncio.wait_for(r.hold_while_full(request("hi")), 0.05)  # the queue allowance
    assert r.held["default"] == []


async def test_a_hold_ends_at_hold_max_s_and_zero_turns_holding_off() -> None:
    r = router(settings(hold_max_s=0.05), beat("w1", running=2, capacity=2))
    await asyncio.wait_for(r.hold_while_full(request("hi")), 1.0)
    off = router(settings(hold_max_s=0), beat("w1", running=2, capacity=2))
    await asyncio.wait_for(off.hold_while_full(request("hi")), 0.05)


async def test_held_requests_count_in_max_pool_queue() -> None:
    r = router(settings(max_pool_queue=2), beat("w1", running=2, waiting=1, capacity=2))
    held = asyncio.create_task(r.hold_while_full(request("hi", rid="a")))
    await asyncio.sleep(0.03)
    assert len(r.held["default"]) == 1
    # waiting 1 + held 1 = the bound: the next is not held, and decide refuses it.
    await asyncio.wait_for(r.hold_while_full(request("hi", rid="b")), 0.05)
    d = r.decide(request("hi", rid="b"))
    assert isinstance(d, Rejection) and d.code == "no_capacity"
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert r.held["default"] == []  # a cancelled hold leaves the line
