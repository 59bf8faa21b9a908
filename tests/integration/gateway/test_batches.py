"""The Files and Batch APIs as the official ``openai`` SDK calls them, on FAKE workers: a batch
answered line for line (bad lines in the error file, billed to the key), refusals, cancel, and
a batch runner, the router and a worker killed mid-batch losing and doubling nothing; each on SQLite and on
PostgreSQL (``TEST_DATABASE_URL``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from bench.support.fleet import GatewayFleet
from libs.db.batches import BatchStore
from libs.db.keys import ensure_dev_key
from libs.settings import Settings
from services.gateway.batch_runner import BatchRunner
from tests.integration.gateway.conftest import eventually, ledger_rows, new_key

pytestmark = pytest.mark.integration

ENDPOINT = "/v1/chat/completions"


def client(base: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


def line(i: int, max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    body = {"model": "auto", "messages": [{"role": "user", "content": f"q{i}"}]}
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": ENDPOINT,
        "body": {**body, "max_tokens": max_tokens, **extra},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


async def submit(c: AsyncOpenAI, lines: list[dict[str, Any]]) -> Any:
    f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await c.batches.create(
        input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h", metadata={"t": "1"}
    )


async def finished(c: AsyncOpenAI, batch_id: str, status: str, timeout: float = 30.0) -> Any:
    async def check() -> Any:
        b = await c.batches.retrieve(batch_id)
        return b if b.status == status else None

    return await eventually(check, timeout=timeout, every=0.1)


async def read_jsonl(c: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await c.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines()]


async def test_batch_through_the_sdk(db_settings: Settings) -> None:
    key = await ensure_dev_key(db_settings)
    other = await new_key(db_settings, "other")
    good = [line(i) for i in range(48)]
    bad = [line(48, stream=True), line(49, foo=1)]
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c, client(base, other) as c2:
            batch = await submit(c, good + bad)
            assert batch.status in ("in_progress", "completed")
            assert batch.request_counts is not None and batch.request_counts.total == 50
            done = await finished(c, batch.id, "completed")
            assert done.request_counts.completed == 48 and done.request_counts.failed == 2
            assert done.metadata == {"t": "1"} and done.completed_at is not None

            out = await read_jsonl(c, done.output_file_id)
            ids = [r["custom_id"] for r in out]
            assert sorted(ids) == sorted(x["custom_id"] for x in good)  # each exactly once
            first = out[0]["response"]
            assert first["status_code"] == 200
            assert first["body"]["object"] == "chat.completion"
            assert first["body"]["usage"]["completion_tokens"] == 3
            errors = {
                r["custom_id"]: r["response"] for r in await read_jsonl(c, done.error_file_id)
            }
            assert set(errors) == {"req-48", "req-49"}
            assert errors["req-48"]["body"]["error"]["param"] == "stream"
            assert errors["req-49"]["body"]["error"]["param"] == "foo"
            assert errors["req-49"]["status_code"] == 400

            page = await c.batches.list(limit=5)
            assert [b.id for b in page.data] == [batch.id]
            with pytest.raises(openai.NotFoundError):
                await c2.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await c2.files.content(done.output_file_id)
            f = await c.files.retrieve(batch.input_file_id)
            assert f.purpose == "batch" and f.bytes == len(jsonl(good + bad))

            # Refusals: a window the fleet cannot promise, another purpose, an unserved endpoint.
            with pytest.raises(openai.BadRequestError) as e:
                await c.batches.create(
                    input_file_id=f.id,
                    endpoint=ENDPOINT,
                    completion_window="1h",  # type: ignore[arg-type]
                )
            assert e.value.body["param"] == "completion_window"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as e:
                await c.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
            assert e.value.body["param"] == "purpose"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as e:
                await c.batches.create(
                    input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
                )
            assert e.value.body["param"] == "endpoint"  # type: ignore[index]
            # A file with a line that cannot run at all fails the batch, naming the line.
            broken = await c.files.create(file=("b.jsonl", b"not json\n"), purpose="batch")
            failed = await c.batches.create(
                input_file_id=broken.id, endpoint=ENDPOINT, completion_window="24h"
            )
            assert failed.status == "failed" and failed.errors is not None
            assert failed.errors.data is not None and failed.errors.data[0].line == 1

    # Billed to the key: one ledger row a line that ran, as priority batch.
    rows = await eventually(lambda: _batch_rows(db_settings, 48), timeout=10.0)
    assert {r.api_key_id for r in rows} == {key.split("-")[2]}


async def _batch_rows(settings: Settings, n: int) -> list[Any]:
    rows = [
        r for r in (await ledger_rows(settings)).values() if r.request_id.startswith("batchreq_")
    ]
    return rows if len(rows) >= n and all(r.status == "ok" for r in rows) else []


async def test_cancel_a_batch(db_settings: Settings) -> None:
    db_settings.fake_engine.per_token_s = 0.02
    db_settings.batch.max_inflight = 2
    key = await ensure_dev_key(db_settings)
    async with GatewayFleet(db_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            batch = await submit(c, [line(i, max_tokens=10) for i in range(40)])

            async def some_done() -> bool:
                b = await c.batches.retrieve(batch.id)
                return b.request_counts is not None and b.request_counts.completed >= 2

            await eventually(some_done)
            cancelling = await c.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = await finished(c, batch.id, "cancelled", timeout=15)
            out = await read_jsonl(c, done.output_file_id)
            assert 2 <= len(out) < 40
            assert len({r["custom_id"] for r in out}) == len(out)
            # Cancelling a completed batch is a 409, as on OpenAI.
            small = await submit(c, [line(0, max_tokens=1)])
            await finished(c, small.id, "completed")
            with pytest.raises(openai.ConflictError):
                await c.batches.cancel(small.id)


async def test_runner_router_and_a_worker_killed_mid_batch(db_settings: Settings) -> None:
    db_settings.fake_engine.per_token_s = 0.01
    db_settings.batch.max_inflight = 4
    db_settings.batch.ack_wait_s = 1.5
    key = await ensure_dev_key(db_settings)
    n = 60
    async with GatewayFleet(db_settings) as fleet:
        doomed = await fleet.add_worker("w1")
        await fleet.add_worker("w2")
        base = await fleet.gateway()
        await fleet.wait_workers(2)
        app = fleet.apps[0]
        runner: BatchRunner = app.state.batch_runner
        async with client(base, key) as c:
            batch = await submit(c, [line(i, max_tokens=8) for i in range(n)])
            await eventually(lambda: _answered(runner, 10))
            await eventually(lambda: _running(doomed.backend))
            # Kill, with lines in flight: a worker (no word, no more beats) with its requests,
            # the runner (its lines unacked) and the router.
            await doomed.kill()
            await runner.stop()
            router_task = fleet._tasks[0]
            router_task.cancel()
            await asyncio.gather(router_task, return_exceptions=True)
            await fleet.add_router()
            fresh = BatchRunner(app.state.settings, app.state.fleet, BatchStore(runner.store.db))
            await fresh.start()
            try:
                done = await finished(c, batch.id, "completed", timeout=60)
            finally:
                await fresh.stop()
            out = await read_jsonl(c, done.output_file_id)
            ids = [r["custom_id"] for r in out]
            assert len(ids) == n and set(ids) == {f"req-{i}" for i in range(n)}
            assert done.request_counts.completed == n and done.request_counts.failed == 0
            # Every answer whole: a line cut on the killed worker was run again or migrated.
            usage = [r["response"]["body"]["usage"]["completion_tokens"] for r in out]
            assert usage == [8] * n
            # Each runner counts the lines it committed. A line whose commit was in flight when
            # the runner was killed can commit uncounted (the await is cancelled, the database
            # write is not): up to batch.max_inflight of them.
            counted = runner.answered + fresh.answered
            assert n - db_settings.batch.max_inflight <= counted <= n


async def _answered(runner: BatchRunner, n: int) -> bool:
    return runner.answered >= n


async def _running(backend: Any) -> bool:
    return backend.load().running > 0
