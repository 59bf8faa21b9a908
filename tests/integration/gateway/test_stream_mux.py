"""The gateway reads every stream it submitted through one subscription (``StreamMux``): its
requests name ``reply.<gateway>.<request_id>`` as ``reply_subject``, no request subscribes on
its own, and streams running at once each get exactly their own tokens."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from bench.support.fleet import GatewayFleet
from libs.protocol import GenerateRequest, Subjects
from libs.settings import Settings
from services.gateway.fleet import Fleet

pytestmark = pytest.mark.integration


async def stream_text(c: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": "auto", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    text = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    return rid, "".join(text)


async def test_concurrent_streams_share_one_subscription_and_keep_their_own_tokens(
    gw_settings: Settings,
) -> None:
    gw_settings.gateway.auth_enabled = False
    gw_settings.fake_engine.per_token_s = 0.002
    subjects = Subjects(gw_settings.nats.subject_prefix)
    replies: dict[str, str] = {}
    spy = await nats.connect(gw_settings.nats.url)

    async def on_request(msg: Msg) -> None:
        req = msgspec.json.decode(msg.data, type=GenerateRequest)
        replies[req.request_id] = req.reply_subject

    await spy.subscribe(subjects.requests, cb=on_request)
    try:
        async with GatewayFleet(gw_settings) as fleet:
            await fleet.add_worker("w1")
            base = await fleet.gateway()
            await fleet.wait_workers(1)
            gw: Fleet = fleet._servers[0].config.app.state.fleet  # type: ignore[union-attr]
            assert gw.nc is not None and gw.mux is not None
            subs_before = len(gw.nc._subs)  # nats-py's live subscriptions of the gateway
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                runs = [stream_text(c, f"prompt {i}", 20 + i) for i in range(8)]
                pending = [asyncio.create_task(r) for r in runs]
                await asyncio.sleep(0.05)
                during = len(gw.nc._subs)
                got = await asyncio.gather(*pending)
            assert during == subs_before and len(gw.mux) == 0
            # The FAKE engine's text for a prompt, alone on a connection of its own.
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                alone = [await stream_text(c, f"prompt {i}", 20 + i) for i in range(8)]
        for (rid, text), (_, ref) in zip(got, alone, strict=True):
            assert text == ref and text
            assert replies[rid] == subjects.reply_stream(gw.gateway_id, rid)
    finally:
        await spy.drain()
