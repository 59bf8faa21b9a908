"""The request path end to end on a real nats-server with FAKE-engine workers."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from bench.support.fleet import InProcessFleet
from libs.protocol import (
    DeadLetter,
    ErrorMessage,
    GenerateRequest,
    Subjects,
    decode_stream,
    encode,
)
from libs.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet_settings(settings: Settings) -> Settings:
    settings.gateway.auth_enabled = False
    settings.pools[0].model = "fake-model"
    settings.pools[0].backend = "fake"
    settings.fake_engine.per_token_s = 0.002
    return settings


async def test_streaming_chat_through_the_fleet(fleet_settings: Settings) -> None:
    async with InProcessFleet(fleet_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        body = {
            "model": "auto",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        choice_chunks = [c for c in chunks if c["choices"]]
        assert [c["choices"][0]["finish_reason"] for c in choice_chunks[:-1]] == [None] * (
            len(choice_chunks) - 1
        )
        assert choice_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_malformed_messages_get_typed_errors_and_services_survive(
    fleet_settings: Settings,
) -> None:
    import nats

    subjects = Subjects(fleet_settings.nats.subject_prefix)
    async with InProcessFleet(fleet_settings) as fleet:
        w = await fleet.add_worker("w1")
        await fleet.wait_workers(1)
        nc = await nats.connect(fleet_settings.nats.url)
        js = nc.jetstream()
        dead: asyncio.Queue[DeadLetter] = asyncio.Queue()

        async def on_dead(msg) -> None:  # type: ignore[no-untyped-def]
            dead.put_nowait(msgspec.json.decode(msg.data, type=DeadLetter))

        await nc.subscribe(subjects.deadletter, cb=on_dead)
        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
            replies.put_nowait(msg.data)

        await nc.subscribe(subjects.stream("badreq"), cb=on_reply)
        await nc.subscribe(subjects.stream("oldv"), cb=on_reply)
        # 1) not JSON at all, on the requests stream: no request id → dead letter.
        await js.publish(subjects.requests, b"\x00not json")
        letter = await asyncio.wait_for(dead.get(), 10)
        assert letter.service == "router" and "JSON" in letter.error
        # 2) a wrong type with a request id → typed error on its stream.
        await js.publish(subjects.requests, b'{"request_id": "badreq", "prompt": 5}')
        err = decode_stream(await asyncio.wait_for(replies.get(), 10))
        assert isinstance(err, ErrorMessage) and err.code == "invalid_request"
        assert "prompt" in err.message
        # 3) an unknown protocol version.
        await js.publish(subjects.requests, b'{"v": 99, "request_id": "oldv", "prompt": "x"}')
        err = decode_stream(await asyncio.wait_for(replies.get(), 10))
        assert isinstance(err, ErrorMessage) and err.code == "unsupported_version"
        # 4) a version that is not even a number, and request ids no subject can carry (huge,
        #    a wildcard, whitespace): dead letters, acked, never redelivered; the router lives.
        huge = "x" * 200_000  # as a subject, far past nats-server's 4 KiB control line
        await nc.subscribe(subjects.stream("listv"), cb=on_reply)
        await nc.flush()
        for bad in (
            b'{"v": [1], "request_id": "listv", "prompt": "x"}',
            b'{"request_id": "' + huge.encode() + b'", "prompt": 5}',
            b'{"request_id": "a>b", "prompt": 5}',
            b'{"request_id": "a b", "prompt": "x"}',
        ):
            await js.publish(subjects.requests, bad)
        err = decode_stream(await asyncio.wait_for(replies.get(), 10))
        assert isinstance(err, ErrorMessage) and err.code == "unsupported_version"
        for _ in range(3):
            assert (await asyncio.wait_for(dead.get(), 10)).service == "router"
        # 5) garbage straight at a worker and at the cancel subject.
        await nc.publish(subjects.work(w.worker_id), b"{]")
        await nc.publish(subjects.cancel("x"), b"[1,2")
        assert (await asyncio.wait_for(dead.get(), 10)).service == "worker"
        assert (await asyncio.wait_for(dead.get(), 10)).service == "worker"
        # The fleet still serves a good request afterwards.
        good = GenerateRequest(request_id="good1", model="default", prompt="still alive?")
        await nc.subscribe(subjects.stream("good1"), cb=on_reply)
        await nc.flush()
        await js.publish(subjects.requests, encode(good))
        kinds = []
        while True:
            m = decode_stream(await asyncio.wait_for(replies.get(), 10))
            kinds.append(type(m).__name__)
            if kinds[-1] in ("Finished", "ErrorMessage"):
                break
        assert kinds[-1] == "Finished"
        await nc.drain()
