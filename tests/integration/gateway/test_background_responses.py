"""Background responses (``background: true``) through the ``openai`` SDK on FAKE workers, on
SQLite and on PostgreSQL: the create answers at once, polling reads the stored result, a
cancel stops the run and sticks, a gateway that stops marks its running ones failed, and a
gateway process killed outright has its running ones marked failed by another replica once their
lease ran out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from bench.support.fleet import GatewayFleet
from bench.support.services import free_port
from libs.db.keys import ensure_dev_key
from libs.settings import Settings
from tests.integration.gateway.conftest import eventually, ledger_rows

pytestmark = pytest.mark.integration


def client(base: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


async def status_is(c: AsyncOpenAI, response_id: str, *statuses: str) -> Any:
    async def check() -> Any:
        r = await c.responses.retrieve(response_id)
        return r if r.status in statuses else None

    return await eventually(check, timeout=15.0, every=0.05)


async def test_background_response_is_polled_to_its_end(db_settings: Settings) -> None:
    db_settings.fake_engine.per_token_s = 0.1
    key = await ensure_dev_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            r = await c.responses.create(
                model="auto", input="tell me about rivers", max_output_tokens=20, background=True
            )
            # Answered before the first token: 20 tokens take 2 s here.
            assert r.status == "queued" and r.background is True and r.output == []
            # Not continuable until it has its output.
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model="auto", input="and?", previous_response_id=r.id)
            assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
            items = await c.responses.input_items.list(r.id)
            assert [i.type for i in items.data] == ["message"]

            done = await status_is(c, r.id, "incomplete", "completed")
            assert done.status == "incomplete"  # cut by max_output_tokens
            assert len(done.output_text.split()) == 20 and done.model == "fake-model"
            assert done.usage is not None and done.usage.output_tokens == 20
            assert done.background is True
            # An ended response is continued like a foreground one, and cancel leaves it be.
            follow = await c.responses.create(
                model="auto", input="and lakes?", previous_response_id=r.id, max_output_tokens=3
            )
            assert follow.usage is not None and follow.usage.input_tokens > 20
            assert (await c.responses.cancel(r.id)).status == "incomplete"
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.retrieve(r.id, stream=True)
            assert e.value.body["param"] == "stream"  # type: ignore[index]

    rows = await ledger_rows(db_settings)
    assert rows[r.id].status == "ok" and rows[r.id].completion_tokens == 20


async def test_cancel_a_background_response(db_settings: Settings) -> None:
    db_settings.fake_engine.per_token_s = 0.05
    db_settings.fake_engine.per_prompt_token_s = 0.05
    db_settings.gateway.max_inflight = 1
    key = await ensure_dev_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            r = await c.responses.create(
                model="auto", input="a long story", max_output_tokens=400, background=True
            )
            await status_is(c, r.id, "in_progress")
            # The gateway is full (gateway.max_inflight): the create itself says so.
            with pytest.raises(openai.InternalServerError) as full:
                await c.responses.create(model="auto", input="x", background=True)
            assert full.value.status_code == 503
            cancelled = await c.responses.cancel(r.id)
            assert cancelled.status == "cancelled" and cancelled.id == r.id
            # The run stopped: the ledger says so, and the stored status stays cancelled.
            row = await eventually(lambda: _ledger_row(db_settings, r.id))
            assert row.status == "cancelled" and row.completion_tokens < 400
            assert (await c.responses.retrieve(r.id)).status == "cancelled"
            assert (await c.responses.cancel(r.id)).status == "cancelled"  # idempotent
            tasks = fleet.apps[0].state.background.tasks
            await eventually(lambda: _true(not tasks))  # the task has ended

            # A cancel before its first token (a 100-word prompt takes 5 s here) stops it
            # while it is still queued.
            queued = await c.responses.create(
                model="auto", input="word " * 100, max_output_tokens=5, background=True
            )
            assert (await c.responses.cancel(queued.id)).status == "cancelled"
            row = await eventually(lambda: _ledger_row(db_settings, queued.id))
            assert row.status == "cancelled" and row.completion_tokens == 0
            assert (await c.responses.retrieve(queued.id)).status == "cancelled"


async def _true(value: bool) -> bool:
    return value


async def _ledger_row(settings: Settings, request_id: str) -> Any:
    return (await ledger_rows(settings)).get(request_id)


async def test_a_stopping_gateway_fails_its_background_responses(db_settings: Settings) -> None:
    """What the gateway's lifespan does last (``BackgroundRuns.stop``), before its database
    closes: a response still running is stored failed, not left in_progress."""
    db_settings.fake_engine.per_token_s = 0.05
    key = await ensure_dev_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            r = await c.responses.create(
                model="auto", input="a long story", max_output_tokens=400, background=True
            )
            await status_is(c, r.id, "in_progress")
            await fleet.apps[0].state.background.stop(5.0)
            failed = await c.responses.retrieve(r.id)
            assert failed.status == "failed" and failed.error is not None
            assert failed.error.code == "server_error"


def gateway_process(settings: Settings, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``strait gateway`` as a process of its own on ``settings`` (every section passed as
    JSON in its ``STRAIT_<SECTION>`` variable, no config file), and its base URL."""
    port = free_port()
    s = settings.model_copy(deep=True)
    s.gateway.port = port
    (tmp / "empty.toml").write_text("")
    env = {**os.environ, "STRAIT_CONFIG": str(tmp / "empty.toml"), "PYTHONUNBUFFERED": "1"}
    for name, value in s.model_dump(mode="json").items():
        if value is not None:
            env[f"STRAIT_{name.upper()}"] = (
                json.dumps(value) if isinstance(value, dict | list) else str(value)
            )
    log = open(tmp / "gateway-process.log", "wb")  # the process keeps it open
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway"], env=env, stdout=log, stderr=log
    )
    return proc, f"http://127.0.0.1:{port}"


async def test_a_killed_gateways_background_responses_fail_by_their_lease(
    db_settings: Settings, tmp_path: Path
) -> None:
    """A gateway process killed outright (SIGKILL: no lifespan, no "failed" write) mid
    background response: another replica's sweep stores it ``failed`` once its lease ran out,
    while that replica's own background response, renewed, runs on to its end."""
    db_settings.fake_engine.per_token_s = 0.1
    db_settings.gateway.background_lease_s = 0.6
    key = await ensure_dev_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        proc, doomed_base = gateway_process(db_settings, tmp_path)
        try:
            async with client(doomed_base, key) as c:

                async def up() -> bool:
                    try:
                        return (await c.models.list()) is not None
                    except openai.APIConnectionError:
                        assert proc.poll() is None, (tmp_path / "gateway-process.log").read_text()
                        return False

                await eventually(up, timeout=60.0, every=0.2)
                await fleet.wait_workers(1)
                # 40 tokens: 4 s, several leases long.
                doomed = await c.responses.create(
                    model="auto", input="tell me", max_output_tokens=40, background=True
                )
                await status_is(c, doomed.id, "in_progress")
            base = await fleet.gateway()
            async with client(base, key) as c:
                kept = await c.responses.create(
                    model="auto", input="tell me too", max_output_tokens=30, background=True
                )
                await status_is(c, kept.id, "in_progress")
                proc.kill()  # SIGKILL: nothing of the gateway runs after this
                proc.wait()
                killed_at = time.monotonic()
                assert (await c.responses.retrieve(doomed.id)).status == "in_progress"
                failed = await status_is(c, doomed.id, "failed", "completed", "incomplete")
                took = time.monotonic() - killed_at
                assert failed.status == "failed", failed.status
                assert failed.error is not None and failed.error.code == "server_error"
                assert "lease ran out" in failed.error.message
                # Within a lease and a sweep interval (plus slack for a loaded machine), well
                # before the 4 s the run itself would have taken.
                assert took < 0.6 + 0.2 + 1.5, took
                done = await status_is(c, kept.id, "incomplete", "completed", "failed")
                assert done.status == "incomplete" and done.usage is not None
                assert done.usage.output_tokens == 30
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
