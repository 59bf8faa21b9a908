"""A request is (team, id) on a secured fleet (docs/security.md#request-identity): teams that
reuse each other's request ids are each served, billed and cancelled apart, and a team added
to a running fleet is served on its first request. Real nats-server with the generated
accounts and TLS, a router and a FAKE worker in the test's loop, the ledger on SQLite and on
PostgreSQL."""

from __future__ import annotations

import asyncio
import ssl

import nats
import pytest
from sqlalchemy import select

from bench.support.services import nats_binary
from libs.client import StraitClient
from libs.db.models import RequestRow
from libs.protocol import ResendRequest, encode
from tests.integration.security.conftest import SecuredFleet
from tests.integration.security.test_teams import eventually

pytestmark = pytest.mark.integration

# max_tokens each sender uses, so that a row billed to the wrong sender shows.
TOKENS = {"alpha": 5, "gamma": 7, "": 9}


async def rows(f: SecuredFleet, rid: str) -> dict[str, RequestRow]:
    async with f.ledger_db.session() as s:
        got = (await s.execute(select(RequestRow).where(RequestRow.request_id == rid))).scalars()
        return {r.origin: r for r in got}


def fleet_client(f: SecuredFleet) -> StraitClient:
    """An internal client of the fleet's own account (its ids are the fleet's)."""
    n = f.settings.nats
    return StraitClient(
        f.url, prefix=n.subject_prefix, nkey_seed_file=n.nkey_seed_file, tls_ca_file=n.tls_ca_file
    )


async def test_two_teams_with_one_request_id_are_both_served_and_billed_apart(
    secured_db: SecuredFleet,
) -> None:
    f = secured_db
    window = f.settings.nats.request_dedupe_window_s
    async with f.client("alpha") as alpha, f.client("gamma") as gamma:
        clients = {"alpha": alpha, "gamma": gamma}
        # Inside the windows: alpha first, gamma at once after it, with alpha's id.
        for team in ("alpha", "gamma"):
            done = await clients[team].complete(
                "hi", request_id="shared-1", max_tokens=TOKENS[team]
            )
            assert done.usage.completion_tokens == TOKENS[team], team
        # The other order, and past the request de-duplication window in between.
        done = await gamma.complete("hi", request_id="shared-2", max_tokens=TOKENS["gamma"])
        assert done.usage.completion_tokens == TOKENS["gamma"]
        await asyncio.sleep(window + 0.2)
        done = await alpha.complete("hi", request_id="shared-2", max_tokens=TOKENS["alpha"])
        assert done.usage.completion_tokens == TOKENS["alpha"]
    # The fleet's own id space (the gateway's, internal clients') is a third.
    async with fleet_client(f) as own:
        done = await own.complete("hi", request_id="shared-1", max_tokens=TOKENS[""])
        assert done.usage.completion_tokens == TOKENS[""]

    for rid, origins in (("shared-1", {"alpha", "gamma", ""}), ("shared-2", {"alpha", "gamma"})):
        got = await eventually(lambda rid=rid, o=origins: _rows_of(f, rid, o))
        assert set(got) == origins, (rid, got)
        for origin, row in got.items():
            assert row.completion_tokens == TOKENS[origin], (rid, origin)
            assert row.team == (origin or None), (rid, origin)
            assert row.status == "ok"


async def _rows_of(f: SecuredFleet, rid: str, origins: set[str]) -> dict[str, RequestRow] | None:
    got = await rows(f, rid)
    return got if set(got) == origins else None


async def test_a_team_cannot_cancel_or_replay_another_teams_request_of_the_same_id(
    secured: SecuredFleet,
) -> None:
    secured.settings.fake_engine.per_token_s = 0.02
    for w in secured.fleet.workers:
        w.backend.settings.per_token_s = 0.02  # type: ignore[attr-defined]
    worker = secured.fleet.workers[0].worker
    async with secured.client("alpha") as alpha, secured.client("gamma") as gamma:
        mine = alpha.generate("a long answer", request_id="same", max_tokens=40)
        theirs = gamma.generate("another", request_id="same", max_tokens=400)
        async with mine, theirs:
            # (One iterator each: a dropped one closes its stream, which cancels it.)
            mine_it, theirs_it = aiter(mine), aiter(theirs)
            first = await anext(mine_it)
            await anext(theirs_it)
            assert {"alpha.same", "gamma.same"} <= set(worker.tasks)  # both run, side by side
            await gamma.cancel("same")  # gamma's own: it stops, alpha's goes on
            assert await eventually(lambda: _gone(worker, "gamma.same"), 5.0)
            rest = [d async for d in mine_it]
        assert first.text and mine.finished is not None
        assert mine.finished.usage.completion_tokens == 40, rest[-1:]

    # A replay of alpha's ended stream: gamma's resend reaches nothing of alpha's.
    p = secured.settings.nats.subject_prefix
    ctx = ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file)
    as_alpha = await nats.connect(
        secured.url, nkeys_seed=str(secured.sf.store.seed_file("alpha")), tls=ctx
    )
    as_gamma = await nats.connect(
        secured.url, nkeys_seed=str(secured.sf.store.seed_file("gamma")), tls=ctx
    )
    try:
        seen = await as_alpha.subscribe(f"{p}.stream.same")
        await as_gamma.publish(
            f"{p}.resend.same", encode(ResendRequest(request_id="same", from_seq=1))
        )
        await as_gamma.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await seen.next_msg(timeout=0.5)
        # The same resend from alpha replays alpha's stream: the check above could fail.
        await as_alpha.publish(
            f"{p}.resend.same", encode(ResendRequest(request_id="same", from_seq=1))
        )
        assert (await seen.next_msg(timeout=5)).data
    finally:
        await as_alpha.close()
        await as_gamma.close()


async def _gone(worker: object, key: str) -> bool:
    return key not in worker.tasks  # type: ignore[attr-defined]


async def test_teams_added_to_a_running_fleet_are_served_on_their_first_request(
    secured: SecuredFleet,
) -> None:
    """What `strait teams add` does, three times over on a running server: each newest team
    is served at once, and the older ones still are (nats-server leaves the imports of an
    account that a reload creates unsubscribed; decision 0020)."""
    sf, binary = secured.sf, nats_binary()
    assert binary is not None
    for name in ("delta", "epsilon", "zeta"):
        sf.store.add(name)
        await sf.ensure_streams([name])
        assert await asyncio.to_thread(sf.apply, binary)
        await sf.announce([])
        for team in (name, "alpha"):
            # Published once: a refused first publish would fail here, not be retried.
            async with secured.client(team, publish_attempts=1) as c:
                done = await c.complete("first", max_tokens=3)
                assert done.usage.completion_tokens == 3, team


async def test_a_subscription_to_every_stream_sees_only_the_teams_own(
    secured: SecuredFleet,
) -> None:
    """`stream.>` is accepted (a wildcard token matches the allowed `stream.*` literally) and,
    through the account's one import, carries the team's own streams only."""
    p = secured.settings.nats.subject_prefix
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    spy = await nats.connect(
        secured.url,
        nkeys_seed=str(secured.sf.store.seed_file("alpha")),
        tls=ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file),
        error_cb=on_error,
    )
    try:
        everything = await spy.subscribe(f"{p}.stream.>")
        async with secured.client("gamma") as gamma:
            assert (await gamma.complete("gamma's", request_id="g1", max_tokens=4)).text
        async with secured.client("alpha") as alpha:
            assert (await alpha.complete("alpha's", request_id="a1", max_tokens=4)).text
        subjects = set()
        while True:
            try:
                subjects.add((await everything.next_msg(timeout=0.5)).subject)
            except nats.errors.TimeoutError:
                break
        assert subjects == {f"{p}.stream.a1"}
        assert not [e for e in errors if "permissions violation" in e.lower()], errors
    finally:
        await spy.close()
