"""The examples run against a FAKE fleet."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from examples import batch_submit, tail_usage
from libs.client import StraitClient

pytestmark = pytest.mark.integration


@pytest.mark.nats_modes("embedded", "secured")
async def test_batch_submit_writes_one_result_per_prompt(
    client: StraitClient, tmp_path: Path
) -> None:
    src = tmp_path / "prompts.jsonl"
    lines = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(20)]
    lines.append({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    lines.append({"id": "bad", "prompt": "x", "model": "no-such-model"})
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results.jsonl"
    items = batch_submit.load_prompts(str(src), 0)
    stats = await batch_submit.run(
        client, items, str(out), concurrency=8, max_tokens=4, progress=False
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [x["id"] for x in lines]
    assert (stats.ok, stats.failed) == (21, 1)
    assert (
        rows[0]["usage"]["completion_tokens"] == 4 and rows[20]["usage"]["completion_tokens"] == 3
    )
    assert rows[-1]["error"]["code"] == "model_not_found"


@pytest.mark.nats_modes("embedded", "secured")
async def test_batch_submit_generates_prompts(client: StraitClient, tmp_path: Path) -> None:
    items = batch_submit.load_prompts(None, 30)
    stats = await batch_submit.run(
        client, items, str(tmp_path / "o.jsonl"), max_tokens=2, progress=False
    )
    assert stats.ok == 30 and stats.requests_per_s > 0


async def test_tail_usage_prints_live_events(client: StraitClient) -> None:
    out = io.StringIO()
    tail = asyncio.create_task(tail_usage.run(client, durable="tail-test", limit=2, out=out))
    await asyncio.sleep(0.3)  # "new" delivery: the tail starts before the requests
    a = await client.complete("one", max_tokens=2)
    b = await client.complete("two", max_tokens=3)
    assert await asyncio.wait_for(tail, 10) == 2
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"{a.request_id} ok key=team-test")
    assert "completion=3" in lines[1] and lines[1].startswith(b.request_id)
