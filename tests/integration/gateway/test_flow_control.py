"""Flow control end to end on a real nats-server with FAKE workers (docs/flow-control.md): a
quiet key beside a flood, two floods by weight, a tenant over its waiting bound (429
over_share), a request past its deadline (504 over HTTP, a typed error on NATS), every request
answered once and in the ledger."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import nats
import pytest

from bench.support.fleet import GatewayFleet
from libs.backend.fake import FakeBackend
from libs.db.keys import FlowTerms, create_key
from libs.protocol import ErrorMessage, GenerateRequest, SamplingParams, Subjects, decode_stream
from libs.settings import Settings
from tests.integration.gateway.conftest import eventually, ledger_rows

pytestmark = pytest.mark.integration

SEATS = 4  # the fake worker's capacity: a flood of several times it queues


def chat(max_tokens: int, stream: bool = True) -> dict[str, object]:
    return {
        "model": "auto",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def key(s: Settings, name: str, **terms: object) -> dict[str, str]:
    _, secret = await create_key(s, name, terms=FlowTerms(**terms))  # type: ignore[arg-type]
    return {"Authorization": f"Bearer {secret}"}


async def fleet_with_one_worker(fleet: GatewayFleet, s: Settings, seats: int = SEATS) -> str:
    backend = FakeBackend(s.fake_engine, "fake-model", capacity=seats, headroom=2, prompt_cost=0.1)
    await fleet.add_worker("w1", backend=backend)
    base = await fleet.gateway()
    await fleet.wait_workers(1)
    return base


async def stream_tokens(
    c: httpx.AsyncClient, headers: dict[str, str], n: int, seen: list[float]
) -> int:
    """One streaming chat; the arrival time of each content chunk goes to ``seen``."""
    async with c.stream("POST", "/v1/chat/completions", json=chat(n), headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":' in line:
                seen.append(time.monotonic())
    return r.status_code


@pytest.fixture
def flow_settings(gw_settings: Settings) -> Settings:
    gw_settings.fake_engine.per_token_s = 0.01
    gw_settings.fake_engine.per_row_s = 0.0
    gw_settings.router.hold_queue_per_worker = 2
    return gw_settings


async def test_a_quiet_key_is_served_at_once_beside_a_flood(flow_settings: Settings) -> None:
    s = flow_settings
    flood, quiet = await key(s, "flood"), await key(s, "quiet")
    async with GatewayFleet(s) as fleet:
        base = await fleet_with_one_worker(fleet, s)
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            floods = [
                asyncio.create_task(stream_tokens(c, flood, 40, [])) for _ in range(6 * SEATS)
            ]
            await asyncio.sleep(0.5)  # every seat and the queue behind them are the flood's
            took = []
            for _ in range(5):
                t0 = time.monotonic()
                first: list[float] = []
                await stream_tokens(c, quiet, 4, first)
                took.append(first[0] - t0)
            # The flood needs ~6 waves of 0.4 s to drain; the quiet key waits for none of them.
            assert max(took) < 0.3, took
            assert not any(t.done() for t in floods[-SEATS:])  # the flood was still queued
            await asyncio.gather(*floods)
    rows = await eventually(lambda: _rows(s, 6 * SEATS + 5))
    assert all(r.status == "ok" for r in rows.values())


async def _rows(s: Settings, n: int) -> dict[str, object] | None:
    rows = await ledger_rows(s)
    return rows if len(rows) == n else None


@pytest.mark.parametrize(("weights", "want"), [((1.0, 1.0), 0.5), ((3.0, 1.0), 0.75)])
async def test_two_floods_share_the_output_tokens_by_weight(
    flow_settings: Settings, weights: tuple[float, float], want: float
) -> None:
    s = flow_settings
    a, b = await key(s, "a", weight=weights[0]), await key(s, "b", weight=weights[1])
    seats = 2 * SEATS  # b's share is 2 seats at 3:1: never none, so no headroom seat for it
    async with GatewayFleet(s) as fleet:
        base = await fleet_with_one_worker(fleet, s, seats)
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            seen: dict[str, list[float]] = {"a": [], "b": []}

            async def keep_open(name: str, headers: dict[str, str], until: float) -> None:
                while time.monotonic() < until:
                    await stream_tokens(c, headers, 10, seen[name])

            end = time.monotonic() + 4.0
            tasks = [
                asyncio.create_task(keep_open(n, h, end))
                for n, h in (("a", a), ("b", b))
                for _ in range(3 * seats)
            ]
            await asyncio.gather(*tasks)
    # Tokens streamed while both floods were open (after a second of warm-up).
    lo, hi = min(seen["a"][0], seen["b"][0]) + 1.0, end - 0.5
    got = {n: sum(lo <= t <= hi for t in ts) for n, ts in seen.items()}
    assert got["a"] / (got["a"] + got["b"]) == pytest.approx(want, abs=0.1), got


async def test_over_its_waiting_bound_a_key_gets_429_over_share(flow_settings: Settings) -> None:
    s = flow_settings
    s.router.hold_queue_per_worker = 0
    bounded = await key(s, "bounded", max_waiting=2)
    async with GatewayFleet(s) as fleet:
        base = await fleet_with_one_worker(fleet, s)
        async with httpx.AsyncClient(base_url=base, headers=bounded, timeout=60) as c:
            first = [
                asyncio.create_task(c.post("/v1/chat/completions", json=chat(60, stream=False)))
                for _ in range(SEATS + 2)  # the seats (the first without waiting), 2 held
            ]
            await asyncio.sleep(0.4)
            r = await c.post("/v1/chat/completions", json=chat(2))
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "over_share"
            assert "max_waiting=2" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert [x.status_code for x in await asyncio.gather(*first)] == [200] * (SEATS + 2)


async def test_a_request_past_its_deadline_ends_typed(flow_settings: Settings) -> None:
    s = flow_settings
    s.router.hold_queue_per_worker = 0
    s.flow.min_in_flight = 0
    s.flow.queue_timeout_s = 0.5
    flood = await key(s, "flood")
    async with GatewayFleet(s) as fleet:
        base = await fleet_with_one_worker(fleet, s)
        async with httpx.AsyncClient(base_url=base, headers=flood, timeout=60) as c:
            busy = [
                asyncio.create_task(c.post("/v1/chat/completions", json=chat(150, stream=False)))
                for _ in range(SEATS)
            ]
            await asyncio.sleep(0.3)
            r = await c.post("/v1/chat/completions", json=chat(2))
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
            # On NATS: the request's own queue_timeout_s, a typed error on its stream.
            subjects = Subjects.of(s.nats)
            nc = await nats.connect(s.nats.url)
            try:
                sub = await nc.subscribe(subjects.stream("nats-deadline"))
                req = GenerateRequest(
                    request_id="nats-deadline",
                    model="default",
                    prompt="hi",
                    sampling=SamplingParams(max_tokens=2),
                    queue_timeout_s=0.3,
                )
                await nc.jetstream().publish(subjects.requests, msgspec.json.encode(req))
                msg = decode_stream((await sub.next_msg(timeout=10)).data)
                assert isinstance(msg, ErrorMessage) and msg.code == "deadline_exceeded"
                assert "queue_timeout_s=0.3" in msg.message
            finally:
                await nc.close()
            assert [x.status_code for x in await asyncio.gather(*busy)] == [200] * SEATS
