"""Observers follow usage events and routing decisions with consumers of their own."""

from __future__ import annotations

import pytest

from libs.client import InvalidRequest, StraitClient, StraitError
from libs.protocol import RouteDecision, UsageEvent

pytestmark = pytest.mark.integration


async def collect(client: StraitClient, kind: str, durable: str | None, n: int) -> list[object]:
    out = []
    async with client.observe(kind, durable, max_idle_s=1.0) as events:  # type: ignore[arg-type]
        async for ev in events:
            out.append(ev)
            if len(out) == n:
                break
    return out


async def test_durable_observers_see_every_event_and_resume(client: StraitClient) -> None:
    ids = [(await client.complete(f"p{i}", max_tokens=2)).request_id for i in range(3)]
    usage = await collect(client, "usage", "team-a", 3)
    assert [e.request_id for e in usage] == ids  # type: ignore[attr-defined]
    assert all(isinstance(e, UsageEvent) and e.api_key_id == "team-test" for e in usage)
    assert all(e.completion_tokens == 2 and e.status == "ok" for e in usage)  # type: ignore[attr-defined]
    routes = await collect(client, "route", "team-a-routes", 3)
    assert all(isinstance(e, RouteDecision) and e.route.worker_id == "w1" for e in routes)
    # Another team's durable sees the same events: nobody takes them from anyone.
    assert len(await collect(client, "usage", "team-b", 3)) == 3
    # team-a resumes after what it acked.
    later = (await client.complete("later", max_tokens=1)).request_id
    assert [e.request_id for e in await collect(client, "usage", "team-a", 5)] == [later]  # type: ignore[attr-defined]


async def test_observer_names_are_checked(client: StraitClient) -> None:
    with pytest.raises(InvalidRequest):
        client.observe("usage", "team.x")
    with pytest.raises(InvalidRequest):
        client.observe("usage", "ledger")  # the fleet's own consumer: never shared
    await collect(client, "usage", "team-c", 0)
    with pytest.raises(StraitError) as e:
        await collect(client, "route", "team-c", 1)  # the durable follows usage events
    assert e.value.code == "durable_conflict"
