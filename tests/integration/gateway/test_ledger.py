"""Keys, limits, the ledger and cancellation, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest

from bench.support.fleet import GatewayFleet
from bench.support.services import free_port
from libs.db import Database
from libs.db.keys import revoke_key
from libs.db.ledger import LedgerWriter
from libs.db.models import RequestRow
from libs.protocol import Subjects, UsageEvent, encode
from libs.security.teams import TeamStore
from libs.settings import Settings
from tests.integration.gateway.conftest import eventually, ledger_rows, new_key

pytestmark = pytest.mark.integration


def chat(max_tokens: int = 3, **extra: object) -> dict[str, object]:
    return {
        "model": "auto",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": max_tokens,
        **extra,
    }


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_one_ledger_row_per_request(db_settings: Settings) -> None:
    secret = await new_key(db_settings, "ledger")
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        usage: dict[str, dict[str, int]] = {}
        async with httpx.AsyncClient(base_url=base, headers=auth(secret), timeout=20) as c:
            for n in (2, 3, 4):
                r = await c.post("/v1/chat/completions", json=chat(n))
                assert r.status_code == 200
                usage[r.json()["id"]] = r.json()["usage"]
            r = await c.post(
                "/v1/completions", json={"model": "default", "prompt": "a b c d", "max_tokens": 5}
            )
            usage[r.json()["id"]] = r.json()["usage"]
            missing = await c.post("/v1/chat/completions", json={**chat(), "model": "nope"})
            assert missing.status_code == 404
            failed_id = missing.headers.get("x-request-id")

        async def rows_written() -> dict[str, RequestRow] | None:
            rows = await ledger_rows(db_settings)
            return rows if len(rows) == 5 else None

        rows = await eventually(rows_written)
        for rid, u in usage.items():
            row = rows[rid]
            assert (row.prompt_tokens, row.completion_tokens) == (
                u["prompt_tokens"],
                u["completion_tokens"],
            )
            assert row.status == "ok" and row.worker_id == "w1" and row.pool == "default"
            assert row.api_key_id == secret.split("-")[2]
            assert row.route_code and row.ttft_s is not None and row.total_s > 0
        errors = [r for r in rows.values() if r.status == "error"]
        assert [(e.error_code, e.completion_tokens) for e in errors] == [("model_not_found", 0)]
        assert failed_id is None or errors[0].request_id == failed_id


async def test_ledger_rows_survive_a_database_outage(db_settings: Settings) -> None:
    db_settings.gateway.ledger_enabled = False  # this test runs the writer itself
    db_settings.gateway.auth_enabled = False
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        nc = await nats.connect(db_settings.nats.url)
        down = Database(
            db_settings, url=f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/down"
        )
        up = Database(db_settings)
        await up.migrate()
        writer = LedgerWriter(db_settings, nc.jetstream(), down)
        try:
            await writer.start()
            async with httpx.AsyncClient(base_url=base, timeout=20) as c:
                ids = [
                    (await c.post("/v1/chat/completions", json=chat(2))).json()["id"]
                    for _ in range(4)
                ]

            async def failed_twice() -> bool:
                return writer.failures >= 2

            await eventually(failed_twice)
            assert await ledger_rows(db_settings) == {}
            writer.db = up  # the database is back

            async def all_rows() -> bool:
                return set(await ledger_rows(db_settings)) == set(ids)

            await eventually(all_rows)

            async def both_sources() -> bool:  # each request: the worker's event, the gateway's
                return writer.written == 8

            await eventually(both_sources)
            rows = await ledger_rows(db_settings)
            assert {r.source for r in rows.values()} == {"gateway"}  # the later event wins
        finally:
            await writer.stop()
            await down.close()
            await up.close()
            await nc.drain()


async def test_a_request_whose_client_reports_nothing_still_gets_its_row(
    db_settings: Settings,
) -> None:
    """The worker's own usage event: a NATS client that reports no usage (or a gateway that
    died mid-request) leaves the ledger its row all the same, attributed to the request's key."""
    from libs.client import StraitClient

    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        await fleet.gateway()  # runs the ledger writer
        await fleet.wait_workers(1)
        async with StraitClient.from_settings(
            db_settings, report_usage=False, api_key_id="team-x"
        ) as client:
            c = await client.complete("a b c", max_tokens=4, ignore_eos=True)

        async def row() -> RequestRow | None:
            return (await ledger_rows(db_settings)).get(c.request_id)

        got = await eventually(row)
        assert got.source == "worker" and got.api_key_id == "team-x" and got.worker_id == "w1"
        assert (got.prompt_tokens, got.completion_tokens) == (3, 4)
        assert got.status == "ok"


async def test_the_client_sides_event_wins_over_the_workers_in_any_order(
    db_settings: Settings,
) -> None:
    """The worker publishes its usage after the stream's end, so it often reaches the ledger
    after the gateway's: it must not replace it. A later event of the same side does."""
    from libs.db.ledger import upsert_usage

    db = Database(db_settings)
    await db.migrate()
    t = time.time()

    def ev(rid: str, source: str, at: float, ttft: float) -> UsageEvent:
        # The team is the fleet's word: only the worker's event names it here.
        return UsageEvent(
            request_id=rid,
            source=source,
            finished_at=at,
            ttft_s=ttft,
            completion_tokens=5,
            team="ops" if source == "worker" else None,
        )

    try:
        # Separate batches (separate transactions), both orders.
        await upsert_usage(db, [ev("gw-first", "gateway", t, 0.5)])
        await upsert_usage(db, [ev("gw-first", "worker", t + 1, 0.1)])
        await upsert_usage(db, [ev("worker-first", "worker", t, 0.1)])
        await upsert_usage(db, [ev("worker-first", "nats-client", t - 1, 0.7)])
        # One batch holding both; then a later and an earlier gateway event.
        await upsert_usage(db, [ev("same", "gateway", t, 0.5), ev("same", "worker", t + 1, 0.1)])
        await upsert_usage(db, [ev("same", "gateway", t + 2, 0.9)])
        await upsert_usage(db, [ev("same", "gateway", t + 1, 0.2)])
    finally:
        await db.close()
    rows = await ledger_rows(db_settings)
    assert (rows["gw-first"].source, rows["gw-first"].ttft_s) == ("gateway", 0.5)
    assert (rows["worker-first"].source, rows["worker-first"].ttft_s) == ("nats-client", 0.7)
    assert (rows["same"].source, rows["same"].ttft_s) == ("gateway", 0.9)
    # Whichever event the row keeps, the worker's team stays on it.
    assert {r.team for r in rows.values()} == {"ops"}


async def test_replicas_share_the_ledger_consumer_and_duplicates_upsert(
    db_settings: Settings,
) -> None:
    nc = await nats.connect(db_settings.nats.url)
    js = nc.jetstream()
    dbs = [Database(db_settings), Database(db_settings)]
    await dbs[0].migrate()
    writers = [LedgerWriter(db_settings, js, db) for db in dbs]
    try:
        for w in writers:
            await w.start()
        subject = Subjects(db_settings.nats.subject_prefix).event("usage")
        now = time.time()
        for i in range(40):
            ev = UsageEvent(
                request_id=f"r{i}", prompt_tokens=i, completion_tokens=1, created_at=now
            )
            await js.publish(subject, encode(ev))
            if i % 4 == 0:  # a redelivered or re-published event
                await js.publish(subject, encode(ev))
        await js.publish(subject, b"not json")

        async def forty() -> bool:
            return (
                len(await ledger_rows(db_settings)) == 40 and sum(w.written for w in writers) >= 50
            )

        await eventually(forty)
        rows = await ledger_rows(db_settings)
        assert all(rows[f"r{i}"].prompt_tokens == i for i in range(40))
    finally:
        for w in writers:
            await w.stop()
        for db in dbs:
            await db.close()
        await nc.drain()


async def test_revoked_key_is_rejected(db_settings: Settings) -> None:
    secret = await new_key(db_settings, "soon-revoked")
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, headers=auth(secret), timeout=20) as c:
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
            assert await revoke_key(db_settings, secret.split("-")[2])
            await asyncio.sleep(db_settings.gateway.key_cache_ttl_s + 0.1)
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            r = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401


async def test_rate_limits_answer_429_with_retry_after(db_settings: Settings) -> None:
    two_rpm = await new_key(db_settings, "rpm", rpm=2)
    few_tokens = await new_key(db_settings, "tpm", tpm=60)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, timeout=20) as c:
            for _ in range(2):
                assert (
                    await c.post("/v1/chat/completions", json=chat(), headers=auth(two_rpm))
                ).status_code == 200
            r = await c.post("/v1/chat/completions", json=chat(), headers=auth(two_rpm))
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 30
            # Tokens: 40 reserved of 60; the next 40 do not fit until the bucket refills.
            assert (
                await c.post("/v1/chat/completions", json=chat(40), headers=auth(few_tokens))
            ).status_code == 200
            r = await c.post("/v1/chat/completions", json=chat(40), headers=auth(few_tokens))
            assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1


async def test_a_key_of_a_team_bills_and_is_limited_as_that_team(db_settings: Settings) -> None:
    """`strait keys create --team ops`: the ledger row names the team, and the router applies
    the team's limits (teams file) to HTTP requests as it does to the team's NATS requests."""
    TeamStore(db_settings.teams_file.parent).add("ops", rpm=2)
    ops, plain = await new_key(db_settings, "ops-key", team="ops"), await new_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, timeout=20) as c:
            ids = []
            for _ in range(2):
                r = await c.post("/v1/chat/completions", json=chat(), headers=auth(ops))
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            r = await c.post("/v1/chat/completions", json=chat(), headers=auth(ops))
            assert r.status_code == 429, r.text
            assert "team 'ops'" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            r = await c.post("/v1/chat/completions", json=chat(), headers=auth(plain))
            assert r.status_code == 200  # a key of no team: no team limit
            other = r.json()["id"]

    async def rows_written() -> dict[str, RequestRow] | None:
        rows = await ledger_rows(db_settings)
        return rows if all(i in rows for i in [*ids, other]) else None

    rows = await eventually(rows_written)
    assert [rows[i].team for i in ids] == ["ops", "ops"] and rows[other].team is None


async def test_a_disconnected_stream_frees_its_worker_slot(db_settings: Settings) -> None:
    db_settings.fake_engine.per_token_s = 0.02
    secret = await new_key(db_settings, "cancel")
    async with GatewayFleet(db_settings) as fleet:
        w = await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, headers=auth(secret), timeout=20) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(500, stream=True)) as r:
                rid = r.headers["x-request-id"]
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                assert w.backend.load().running == 1 and rid in w.worker.tasks
            # Leaving the block closes the connection mid-stream.

        async def freed() -> bool:
            return w.backend.load().running == 0 and not w.worker.tasks

        await eventually(freed, timeout=5)

        async def cancelled_row() -> bool:
            row = (await ledger_rows(db_settings)).get(rid)
            return row is not None and row.status == "cancelled"

        await eventually(cancelled_row)
