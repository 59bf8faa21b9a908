"""The request-body limit (``gateway.max_body_bytes``): oversized POSTs get 413 in OpenAI's error
shape before the body is parsed, whether they declare a ``Content-Length`` or arrive chunked;
bodies within the limit, and streaming answers, are unaffected."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from bench.support.fleet import GatewayFleet
from libs.settings import Settings

pytestmark = pytest.mark.integration

LIMIT = 64 * 1024  # bytes: this test's gateway.max_body_bytes
CHUNK = 8 * 1024  # bytes per chunk of the chunked uploads
READ_TIMEOUT_S = 5.0
CHAT = "/v1/chat/completions"


def body_of(size: int) -> bytes:
    """A JSON chat body of exactly ``size`` bytes whose ``messages`` is a string: any parser that
    reads it answers 400 for ``messages``, so a 400 (not 413) proves the body was parsed."""
    head, tail = b'{"model": "fake-model", "messages": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def assert_too_large(status: int, body: bytes) -> None:
    assert status == 413, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large"
    assert err["type"] == "invalid_request_error"
    assert err["param"] is None
    assert "gateway.max_body_bytes" in err["message"] and str(LIMIT) in err["message"]


async def raw_post(base: str, head: dict[str, str], parts: list[bytes]) -> tuple[int, bytes]:
    """POST over a bare socket: send the headers and ``parts`` (the body is left unfinished when
    they fall short of it), then read the answer's status and body."""
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        lines = [f"POST {CHAT} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in head.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        for p in parts:
            writer.write(p)
        await writer.drain()
        head_raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        status_line, *header_lines = head_raw.decode("latin-1").split("\r\n")
        headers = dict(h.lower().split(": ", 1) for h in header_lines if h)
        length = int(headers["content-length"])
        body = await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT_S)
    finally:
        writer.close()
    return int(status_line.split()[1]), body


def chunked(data: bytes) -> list[bytes]:
    """``data`` as HTTP/1.1 chunks of ``CHUNK`` bytes, without the terminating chunk."""
    return [
        f"{len(data[i : i + CHUNK]):x}\r\n".encode() + data[i : i + CHUNK] + b"\r\n"
        for i in range(0, len(data), CHUNK)
    ]


async def stream_of(data: bytes) -> AsyncIterator[bytes]:
    """``data`` as an upload with no length (httpx sends it chunked)."""
    for i in range(0, len(data), CHUNK):
        yield data[i : i + CHUNK]


async def test_oversized_bodies_get_413_before_they_are_parsed(gw_settings: Settings) -> None:
    gw_settings.gateway.auth_enabled = False
    gw_settings.gateway.max_body_bytes = LIMIT
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        json_type = {"Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=base, headers=json_type, timeout=30) as c:
            # One byte over, declared: 413 with the error shape.
            r = await c.post(CHAT, content=body_of(LIMIT + 1))
            assert_too_large(r.status_code, r.content)
            # Declared over but not one byte sent: answered at once, nothing read.
            assert_too_large(*await raw_post(base, {"Content-Length": str(LIMIT + 1)}, []))
            # Chunked, one byte over and never finished: answered as soon as the limit passes.
            over = chunked(body_of(LIMIT + 1))
            assert_too_large(*await raw_post(base, {"Transfer-Encoding": "chunked"}, over))
            # Chunked through httpx (no Content-Length), well over: 413 too.
            r = await c.post(CHAT, content=stream_of(body_of(4 * LIMIT)))
            assert "content-length" not in r.request.headers
            assert_too_large(r.status_code, r.content)

            # At the limit, declared or chunked: parsed, so the schema's own 400 for `messages`.
            for content in (body_of(LIMIT), stream_of(body_of(LIMIT))):
                r = await c.post(CHAT, content=content)
                assert r.status_code == 400, r.text[:300]
                assert r.json()["error"]["param"] == "messages"

            # An ordinary streaming chat still streams to its end.
            chat: dict[str, Any] = {
                "model": "fake-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
            }
            async with c.stream("POST", CHAT, json=chat) as r:
                assert r.status_code == 200
                raw = b"".join([part async for part in r.aiter_bytes()])
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            # Other methods pass through untouched.
            assert (await c.get("/health")).json() == {"status": "ok"}


async def test_a_request_over_nats_max_payload_is_a_413(gw_settings: Settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A body the gateway accepts but the fleet's NATS cannot carry: the sender's 413, not a
    503 that tells clients to retry (found by bench/hostile.py)."""
    from bench.support.services import nats_server

    gw_settings.gateway.auth_enabled = False
    gw_settings.gateway.max_body_bytes = LIMIT
    with nats_server(tmp_path / "small", max_payload=LIMIT // 2) as url:
        gw_settings.nats.url = url
        async with GatewayFleet(gw_settings) as fleet:
            await fleet.add_worker("w1")
            base = await fleet.gateway()
            await fleet.wait_workers(1)
            chat = {
                "model": "fake-model",
                "messages": [{"role": "user", "content": "x" * (LIMIT * 3 // 4)}],
                "max_tokens": 4,
            }
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                r = await c.post(CHAT, json=chat)
                assert r.status_code == 413, r.text[:300]
                err = r.json()["error"]
                assert err["code"] == "request_too_large" and "max_payload" in err["message"]
                chat["messages"] = [{"role": "user", "content": "hi"}]
                assert (await c.post(CHAT, json=chat)).status_code == 200
