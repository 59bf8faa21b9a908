"""Backpressure (in-flight bound, pool queue depth) and the request span's trace context."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import nats
import pytest
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.support.fleet import GatewayFleet
from libs.backend.fake import FakeBackend
from libs.protocol import GenerateRequest, Subjects
from libs.settings import Settings
from services.gateway import completions
from tests.integration.gateway.conftest import eventually

pytestmark = pytest.mark.integration


def chat(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "auto",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def test_deep_pool_queue_is_429_and_full_gateway_is_503(gw_settings: Settings) -> None:
    gw_settings.gateway.auth_enabled = False
    gw_settings.gateway.shed_queue_depth = 2
    gw_settings.gateway.max_inflight = 4
    gw_settings.fake_engine.per_token_s = 0.05
    async with GatewayFleet(gw_settings) as fleet:
        w = await fleet.add_worker(
            "w1", backend=FakeBackend(gw_settings.fake_engine, "fake-model", capacity=1)
        )
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            # One running and two waiting in the worker; their beats reach the gateway.
            holds = [
                asyncio.create_task(c.post("/v1/chat/completions", json=chat(40))) for _ in range(3)
            ]

            async def queued() -> bool:
                return w.backend.load().waiting == 2

            await eventually(queued)
            await asyncio.sleep(gw_settings.worker.beat_interval_s * 2)
            r = await c.post("/v1/chat/completions", json=chat(2))
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert "gateway.shed_queue_depth" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
            # With the queue bound lifted, the in-flight bound (3 held + 1 more = 4) answers 503.
            gateway = fleet._servers[0].config.app.state.settings.gateway  # type: ignore[union-attr]
            gateway.shed_queue_depth = 100
            holds.append(asyncio.create_task(c.post("/v1/chat/completions", json=chat(40))))
            await asyncio.sleep(0.2)
            r = await c.post("/v1/chat/completions", json=chat(2))
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
            assert r.headers["retry-after"] == "1"
            for h in holds:
                h.cancel()
            await asyncio.gather(*holds, return_exceptions=True)


async def test_the_request_span_travels_to_the_router(
    gw_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw_settings.gateway.auth_enabled = False
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(completions, "_tracer", provider.get_tracer("test"))
    headers: list[dict[str, str]] = []
    nc = await nats.connect(gw_settings.nats.url)

    async def on_request(msg: Msg) -> None:
        req = msgspec.json.decode(msg.data, type=GenerateRequest)
        headers.append({**(msg.headers or {}), "request_id": req.request_id})

    await nc.subscribe(Subjects(gw_settings.nats.subject_prefix).requests, cb=on_request)
    try:
        async with GatewayFleet(gw_settings) as fleet:
            await fleet.add_worker("w1")
            base = await fleet.gateway()
            await fleet.wait_workers(1)
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json=chat(2))
                assert r.status_code == 200
        (span,) = [s for s in exporter.get_finished_spans() if s.name == "gateway.request"]
        assert span.attributes is not None
        assert span.attributes["strait.request_id"] == r.json()["id"]
        assert span.attributes["strait.status"] == "ok"
        assert span.attributes["strait.model"] == "auto"
        assert span.context is not None
        (sent,) = headers
        assert sent["request_id"] == r.json()["id"]
        assert sent["traceparent"].split("-")[1] == f"{span.context.trace_id:032x}"
    finally:
        await nc.drain()


async def test_a_fast_worker_does_not_overrun_the_gateway(gw_settings: Settings) -> None:
    """More stream messages than the reader's default buffer (4096) arrive at once."""
    gw_settings.gateway.auth_enabled = False
    gw_settings.fake_engine.per_token_s = 0.0
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            body = {"model": "auto", "prompt": "go", "max_tokens": 400, "n": 16}
            r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 6400
