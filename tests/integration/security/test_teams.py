"""Teams on NATS against a real nats-server configured with the generated accounts and TLS
(docs/security.md): own tokens, isolation, attribution, limits, revocation, TLS."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import time

import msgspec
import nats
import pytest
from nats.errors import Error as NatsError
from sqlalchemy import select

from libs.client import PermissionDenied, RateLimited, error_from_message
from libs.db.models import RequestRow
from libs.protocol import (
    ErrorMessage,
    GenerateRequest,
    SamplingParams,
    Subjects,
    decode_stream,
    encode,
)
from libs.security.tls import ensure_dev_tls
from libs.wire.nats_util import connect
from tests.integration.security.conftest import SecuredFleet

pytestmark = pytest.mark.integration

# What nats-py raises for a connection the server or the TLS handshake refuses.
REFUSED = (NatsError, OSError)


async def eventually(check, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def ledger_row(f: SecuredFleet, rid: str) -> RequestRow | None:
    async with f.ledger_db.session() as s:
        return (
            await s.execute(select(RequestRow).where(RequestRow.request_id == rid))
        ).scalar_one_or_none()


async def test_a_team_gets_its_tokens_and_the_ledger_names_the_real_sender(
    secured: SecuredFleet,
) -> None:
    async with secured.client("alpha") as alpha:
        assert alpha.report_usage is False  # a team cannot publish usage: the fleet records it
        done = await alpha.complete("hello there", max_tokens=5, api_key_id=None)
        assert done.usage.completion_tokens == 5 and done.text
        # A forged attribution: another team's name, key label and stream in the payload.
        forged = alpha.request("forge this", max_tokens=4)
        forged = msgspec.structs.replace(
            forged,
            team="beta",
            api_key_id="beta-key",
            reply_subject=Subjects(alpha.subjects.prefix).team_stream("beta", forged.request_id),
        )
        gen = alpha.submit_raw(encode(forged), forged.request_id)
        async with gen:
            text = "".join([d.text async for d in gen])
        assert text and gen.finished is not None  # its tokens came to alpha, not to beta

    for rid in (done.request_id, forged.request_id):
        row = await eventually(lambda rid=rid: ledger_row(secured, rid))
        assert row is not None, rid
        assert row.team == "alpha" and row.api_key_id is None
        assert row.source == "worker" and row.status == "ok"


async def test_a_team_sees_nothing_of_another_and_reaches_no_fleet_subject(
    secured: SecuredFleet,
) -> None:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    p = secured.settings.nats.subject_prefix
    spy = await nats.connect(
        secured.url,
        nkeys_seed=str(secured.sf.store.seed_file("alpha")),
        tls=ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file),
        error_cb=on_error,
    )
    seen: list[str] = []

    async def record(msg: nats.aio.msg.Msg) -> None:
        seen.append(msg.subject)

    try:
        await spy.subscribe(f"{p}.stream.*", cb=record)  # allowed: alpha's own streams
        for forbidden in (f"{p}.stream.beta.*", f"{p}.events.>", f"{p}.work.*", "$JS.API.>"):
            await spy.subscribe(forbidden, cb=record)
        await spy.publish(f"{p}.work.w1", b"{}")
        await spy.publish(f"{p}.workers.default.aggregated.w9", b"{}")
        await spy.publish(f"$JS.API.STREAM.INFO.{secured.settings.nats.requests_stream}", b"")
        await spy.flush()
        async with secured.client("beta") as beta:
            done = await beta.complete("beta's secret prompt", max_tokens=6)
            assert done.usage.completion_tokens == 6
        await asyncio.sleep(0.3)
        assert seen == []  # not one message of beta's stream reached alpha
        for what in (
            f'subscription to "{p}.stream.beta.*"',
            f'subscription to "{p}.events.>"',
            f'subscription to "{p}.work.*"',
            'subscription to "$JS.API.>"',
            f'publish to "{p}.work.w1"',
            f'publish to "{p}.workers.default.aggregated.w9"',
        ):
            # (nats-py lower-cases the subject of some violations)
            hit = [e for e in errors if "permissions violation" in e and what.lower() in e.lower()]
            assert hit, (what, errors)
    finally:
        await spy.close()


async def test_a_team_cannot_cancel_another_teams_request(secured: SecuredFleet) -> None:
    secured.settings.fake_engine.per_token_s = 0.02
    for w in secured.fleet.workers:
        w.backend.settings.per_token_s = 0.02  # type: ignore[attr-defined]
    async with secured.client("alpha") as alpha, secured.client("gamma") as gamma:
        gen = gamma.generate("a long answer", max_tokens=40)
        async with gen:
            it = aiter(gen)
            first = await anext(it)
            await alpha.cancel(gen.request_id)  # reaches cancel.alpha.<id>: not alpha's request
            rest = [d async for d in it]
        assert first.text and gen.finished is not None
        assert gen.finished.usage.completion_tokens == 40, rest[-1:]
        # Its own cancel works: gamma leaves early, the worker drops it.
        own = gamma.generate("another long answer", max_tokens=400)
        async with own:
            await anext(aiter(own))
        w = secured.fleet.workers[0].worker
        assert await eventually(lambda: _no_tasks(w), 5.0)


async def _no_tasks(w: object) -> bool:
    return not w.tasks


async def test_team_rate_limits_answer_rate_limited_on_nats(secured: SecuredFleet) -> None:
    async with secured.client("beta") as beta:  # beta: 2 requests a minute
        for _ in range(2):
            await beta.complete("one", max_tokens=2)
        with pytest.raises(RateLimited) as e:
            await beta.complete("three", max_tokens=2)
        assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
        assert "team 'beta'" in str(e.value)
    async with secured.client("alpha") as alpha:  # another team's budget is its own
        for _ in range(3):
            await alpha.complete("one", max_tokens=2)


async def test_a_revoked_team_is_refused_at_once_and_its_requests_cancelled(
    secured: SecuredFleet, tmp_path: object
) -> None:
    secured.settings.fake_engine.per_token_s = 0.05
    for w in secured.fleet.workers:
        w.backend.settings.per_token_s = 0.05  # type: ignore[attr-defined]
    seed_copy = secured.sf.dir / "gamma-copy.nk"
    shutil.copy(secured.sf.store.seed_file("gamma"), seed_copy)
    worker = secured.fleet.workers[0].worker
    async with secured.client("gamma") as gamma:
        gen = gamma.generate("keep talking", max_tokens=400)
        async with gen:
            await anext(aiter(gen))
            assert worker.tasks
            t0 = time.monotonic()
            # What `strait teams revoke gamma` does.
            secured.sf.store.revoke("gamma")
            secured.sf.write_config()
            assert secured.sf.reload_server(_binary())
            await secured.sf.announce(["gamma"])
            assert await eventually(lambda: _no_tasks(worker), 3.0)
            cancelled_s = time.monotonic() - t0
            await eventually(lambda: _closed(gamma), 3.0)
            assert not gamma.nc.is_connected
    assert cancelled_s < 2.0
    with pytest.raises(NatsError):
        await nats.connect(
            secured.url,
            nkeys_seed=str(seed_copy),
            tls=ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file),
            allow_reconnect=False,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )
    # A request gamma had queued but the router had not taken is refused, not run.
    fleet_nc = await connect(secured.settings.nats, "test-fleet")
    try:
        subjects = Subjects(secured.settings.nats.subject_prefix)
        req = GenerateRequest(
            request_id="late-gamma", prompt="x", sampling=SamplingParams(max_tokens=2)
        )
        sub = await fleet_nc.subscribe(subjects.team_stream("gamma", req.request_id))
        await fleet_nc.jetstream().publish(subjects.team_requests("gamma"), encode(req))
        msg = await sub.next_msg(timeout=5)
        refused = decode_stream(msg.data)
        assert isinstance(refused, ErrorMessage)
        assert isinstance(error_from_message(refused), PermissionDenied)
    finally:
        await fleet_nc.close()


async def _closed(client: object) -> bool:
    return not client.nc.is_connected  # type: ignore[attr-defined]


def _binary() -> str:
    from bench.support.services import nats_binary

    b = nats_binary()
    assert b is not None
    return b


async def test_tls_is_required_and_verified(secured: SecuredFleet, tmp_path: object) -> None:
    port = secured.sf.port
    seed = str(secured.sf.store.seed_file("alpha"))
    with pytest.raises(REFUSED):  # plain TCP: the server requires TLS
        await nats.connect(
            f"nats://127.0.0.1:{port}",
            nkeys_seed=seed,
            allow_reconnect=False,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )
    other = ensure_dev_tls(secured.sf.dir / "other-ca", ["127.0.0.1"])
    with pytest.raises(REFUSED):  # TLS, but a certificate from a CA the client does not trust
        await nats.connect(
            f"tls://127.0.0.1:{port}",
            nkeys_seed=seed,
            tls=ssl.create_default_context(cafile=str(other.ca)),
            allow_reconnect=False,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )
    with pytest.raises(REFUSED):  # TLS and trusted, but no credentials
        await nats.connect(
            f"tls://127.0.0.1:{port}",
            tls=ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file),
            allow_reconnect=False,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )
    ok = await nats.connect(
        f"tls://127.0.0.1:{port}",
        nkeys_seed=seed,
        tls=ssl.create_default_context(cafile=secured.settings.nats.tls_ca_file),
    )
    assert ok.is_connected
    await ok.close()
