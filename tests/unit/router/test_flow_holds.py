"""Flow control in the router's holds (hand-built registries, no NATS): held requests leave in
fair-share order between tenants, a tenant with nothing in flight is not held, a tenant at its
waiting bound gets over_share, and a request past its queue deadline deadline_exceeded."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest

from libs.protocol import Finished, GenerateRequest, Usage
from libs.settings import Settings
from services.router.holds import Refused
from services.router.router import Router
from tests.unit.router.helpers import beat, registry, request

pytestmark = pytest.mark.unit


def router(**flow: object) -> Router:
    s = Settings()
    s.router.hold_queue_per_worker = 0
    s.router.sweep_interval_s = 0.01
    for k, v in flow.items():
        setattr(s.flow, k, v)
    return Router(None, None, s, registry(beat("w1", running=2, capacity=2)), rng=random.Random(0))  # type: ignore[arg-type]


def of(tenant: str, rid: str, **kw: object) -> GenerateRequest:
    return msgspec.structs.replace(request("hi", rid=rid), api_key_id=tenant, **kw)


async def until(pred: object, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.005)


async def test_a_tenant_with_nothing_in_flight_is_not_held_behind_a_flood() -> None:
    r = router()
    flood = [of("flood", f"f{i}") for i in range(4)]
    r.flow.arrive(flood[0], "default")
    r.flow.placed(flood[0])  # the flood has one in flight
    held = [asyncio.create_task(r.hold_while_full(q)) for q in flood[1:]]
    await until(lambda: len(r.held.get("default", [])) == 3)
    # The quiet tenant's request goes at once, though three of the flood's wait before it.
    await asyncio.wait_for(r.hold_while_full(of("quiet", "q1")), 0.05)
    r.flow.placed(of("quiet", "q1"))
    # Its second, while the first is still in flight, waits its turn like anyone's.
    second = asyncio.create_task(r.hold_while_full(of("quiet", "q2")))
    await until(lambda: len(r.held["default"]) == 4)
    for t in [*held, second]:
        t.cancel()
    await asyncio.gather(*held, second, return_exceptions=True)


async def test_held_requests_leave_by_their_tenants_counters_not_by_arrival() -> None:
    r = router()
    # Both have one in flight (active from the start); a's asks for 400 tokens, b's for 10.
    firsts = [
        of(t, f"{t}0", sampling=msgspec.structs.replace(request("x").sampling, max_tokens=n))
        for t, n in (("a", 400), ("b", 10))
    ]
    for q in firsts:
        r.flow.arrive(q, "default")
    for q in firsts:
        r.flow.placed(q)
    order: list[str] = []

    async def arrive(q: GenerateRequest) -> None:
        await r.hold_while_full(q)
        order.append(q.request_id)
        r.flow.placed(q)
        r.registry.on_assigned("w1")

    tasks = [asyncio.create_task(arrive(of("a", f"a{i}"))) for i in range(1, 4)]
    await asyncio.sleep(0.03)
    tasks += [asyncio.create_task(arrive(of("b", f"b{i}"))) for i in range(1, 4)]
    await until(lambda: len(r.held["default"]) == 6)
    r.registry.on_beat(beat("w1", running=0, capacity=2))  # two seats free
    await until(lambda: len(order) == 2)
    assert sorted(order) == ["b1", "b2"]  # b is further under its share, though a came first
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_tenant_at_its_waiting_bound_is_refused_over_share() -> None:
    r = router(max_waiting=2, min_in_flight=0)
    held = [asyncio.create_task(r.hold_while_full(of("a", f"a{i}"))) for i in range(2)]
    await until(lambda: len(r.held.get("default", [])) == 2)
    with pytest.raises(Refused) as e:
        await r.hold_while_full(of("a", "a2"))
    assert e.value.rejection.code == "over_share"
    assert "flow.max_waiting=2" in e.value.rejection.message
    assert e.value.rejection.retry_after_s is not None
    # The bound is the tenant's: another tenant is still held, and a key's own bound wins.
    other = asyncio.create_task(r.hold_while_full(of("b", "b0")))
    await until(lambda: len(r.held["default"]) == 3)
    with pytest.raises(Refused):
        await r.hold_while_full(of("c", "c0", tenant_max_waiting=0))
    for t in [*held, other]:
        t.cancel()
    await asyncio.gather(*held, other, return_exceptions=True)


async def test_a_request_held_past_its_deadline_ends_with_deadline_exceeded() -> None:
    r = router(min_in_flight=0)
    hold = r.hold_while_full(of("a", "a0", queue_timeout_s=0.1))
    with pytest.raises(Refused) as e:
        await asyncio.wait_for(hold, 2.0)
    assert e.value.rejection.code == "deadline_exceeded"
    assert "queue_timeout_s=0.1" in e.value.rejection.message
    assert r.held["default"] == []


def test_the_output_estimate_is_corrected_when_the_stream_ends() -> None:
    r = router()
    q = of("a", "a0")
    r.flow.arrive(q, "default")
    r.flow.placed(q)
    charged = r.flow.share("default").counter("key:a")
    r.flow.ended(
        q, Finished(seq=3, request_id="a0", usage=Usage(prompt_tokens=1, completion_tokens=4))
    )
    assert "key:a" not in r.flow.share("default").counters  # it left with its last request
    assert r.flow.share("default").idle["key:a"] == pytest.approx(charged - 12)  # 16 estimated
    assert r.flow.in_flight == {} and r.flow.entries == {}


def test_entries_are_bounded_when_ends_are_never_seen() -> None:
    r = router()
    r.flow.max_entries = 3
    for i in range(5):
        q = of("a", f"a{i}")
        r.flow.arrive(q, "default")
        r.flow.placed(q)
    assert len(r.flow.entries) == 3 and r.flow.in_flight == {("default", "key:a"): 3}
