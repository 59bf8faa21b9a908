"""A client written only from docs/nats-api.md: raw nats-py and JSON, no Strait imports on the
wire path (the fleet fixture is the only Strait code involved)."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest

from bench.support.fleet import InProcessFleet

# Each test runs against the embedded server and, as a team, a secured one (conftest).
pytestmark = [pytest.mark.integration, pytest.mark.nats_modes("embedded", "secured")]


async def test_raw_request_reads_the_whole_stream_and_usage(fleet: InProcessFleet) -> None:
    prefix = fleet.settings.nats.subject_prefix  # "strait.v1" in production
    nc = await nats.connect(fleet.settings.nats.url, **fleet.client_options)
    js = nc.jetstream()
    request_id = f"raw-{uuid.uuid4().hex}"
    inbox: asyncio.Queue[dict] = asyncio.Queue()  # type: ignore[type-arg]

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        inbox.put_nowait(json.loads(msg.data))

    # 2. subscribe before publishing, and flush.
    sub = await nc.subscribe(f"{prefix}.stream.{request_id}", cb=on_msg)
    await nc.flush()
    # 3. JetStream publish; the PubAck means the request is stored.
    request = {
        "v": 1, "request_id": request_id, "model": "auto",
        "messages": [{"role": "user", "content": "Hello"}],
        "sampling": {"max_tokens": 5, "n": 2}, "want_route": True,
        "a_field_from_the_future": {"ignored": True},
    }  # fmt: skip
    ack = await js.publish(f"{prefix}.requests", json.dumps(request).encode())
    assert ack.seq >= 1
    # 4. read until exactly one "finished" or "error", in seq order.
    messages = []
    while not messages or messages[-1]["type"] not in ("finished", "error"):
        messages.append(await asyncio.wait_for(inbox.get(), 10))
    await sub.unsubscribe()
    await nc.drain()

    assert [m["seq"] for m in messages] == list(range(1, len(messages) + 1))
    assert messages[0]["type"] == "routed"
    deltas = [m for m in messages if m["type"] == "delta"]
    texts = {0: "", 1: ""}
    for d in deltas:
        texts[d["index"]] += d["text"]
    assert all(len(t.split()) == 5 for t in texts.values())
    assert sorted(d["finish_reason"] for d in deltas if d["finish_reason"]) == ["length", "length"]
    finished = messages[-1]
    assert finished["type"] == "finished" and finished["request_id"] == request_id
    assert finished["usage"]["completion_tokens"] == 10 and finished["usage"]["prompt_tokens"] > 0


async def test_raw_cancel_stops_the_worker(fleet: InProcessFleet) -> None:
    prefix = fleet.settings.nats.subject_prefix
    backend = fleet.workers[0].backend
    backend.settings.per_token_s = 0.05  # type: ignore[attr-defined]
    nc = await nats.connect(fleet.settings.nats.url, **fleet.client_options)
    request_id = f"raw-{uuid.uuid4().hex}"
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        got.put_nowait(msg.data)

    await nc.subscribe(f"{prefix}.stream.{request_id}", cb=on_msg)
    await nc.flush()
    body = {"v": 1, "request_id": request_id, "prompt": "go", "sampling": {"max_tokens": 500}}
    await nc.jetstream().publish(f"{prefix}.requests", json.dumps(body).encode())
    assert json.loads(await asyncio.wait_for(got.get(), 10))["type"] == "delta"
    cancel = {"v": 1, "request_id": request_id, "reason": "done reading"}
    await nc.publish(f"{prefix}.cancel.{request_id}", json.dumps(cancel).encode())
    for _ in range(100):
        if backend.load().running == 0:
            break
        await asyncio.sleep(0.02)
    assert backend.load().running == 0
    await nc.drain()
