"""Every error a client can meet arrives as its own exception class, and bad input never
crashes the fleet."""

from __future__ import annotations

import asyncio
import json
from typing import get_args

import pytest

from bench.support.fleet import InProcessFleet, running_fleet
from libs.client import (
    ERROR_CLASSES,
    ContextLengthExceeded,
    Generation,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    NoWorker,
    PayloadTooLarge,
    Retryable,
    StraitClient,
    StraitError,
    UnsupportedVersion,
    WorkerLost,
)
from libs.protocol import ErrorCode, ErrorMessage, Subjects, encode
from libs.settings import Settings
from libs.wire.nats_util import provision

# Each fleet/client test runs against the embedded server and, as a team, a secured one.
pytestmark = [pytest.mark.integration, pytest.mark.nats_modes("embedded", "secured")]


async def read_all(gen: Generation) -> None:
    async with gen:
        async for _ in gen:
            pass


async def test_model_not_found(client: StraitClient) -> None:
    with pytest.raises(ModelNotFound) as e:
        await client.complete("x", model="no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message


async def test_context_length_exceeded(client: StraitClient) -> None:
    with pytest.raises(ContextLengthExceeded) as e:
        await client.complete("x y z", max_tokens=4096)
    assert isinstance(e.value, InvalidRequest) and "4096" in e.value.message


async def test_invalid_request_from_the_worker(client: StraitClient) -> None:
    with pytest.raises(InvalidRequest) as e:
        await client.complete(prompt_token_ids=[10**9])
    # The engine's one check names the field as the wire has it (the real engine's name).
    assert e.value.code == "invalid_request" and e.value.param == "prompt_token_ids"


async def test_no_worker_is_retryable(fleet_settings: Settings) -> None:
    async with running_fleet(fleet_settings, workers=0) as fleet:
        async with StraitClient.from_settings(fleet.settings) as c:
            with pytest.raises(NoWorker) as e:
                await c.complete("anyone?")
    assert isinstance(e.value, Retryable) and e.value.retry_after_s


async def test_no_capacity_when_the_pool_queue_is_full(fleet_settings: Settings) -> None:
    fleet_settings.router.max_pool_queue = 0
    async with running_fleet(fleet_settings) as fleet:
        async with StraitClient.from_settings(fleet.settings) as c:
            with pytest.raises(NoCapacity) as e:
                await c.complete("busy?")
    assert "router.max_pool_queue" in e.value.message and isinstance(e.value, Retryable)


async def test_worker_lost_when_the_worker_shuts_down_mid_stream(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    """The worker drains (as on SIGTERM) past its deadline and stops beating; with no other
    worker to move the request to, the router ends the stream with worker_lost."""
    w = fleet.workers[0]
    w.backend.settings.per_token_s = 0.05  # type: ignore[attr-defined]
    async with client.generate("long", max_tokens=500) as gen:
        with pytest.raises(WorkerLost):
            async for _ in gen:
                if not w.beats.done():
                    await w.worker.drain(0.01)
                    w.beats.cancel()


async def test_every_wire_error_code_maps_to_its_class(fleet_settings: Settings) -> None:
    """A scripted responder answers each request with the error code named in its prompt."""
    import nats

    subjects = Subjects(fleet_settings.nats.subject_prefix)
    nc = await nats.connect(fleet_settings.nats.url)
    await provision(nc.jetstream(), fleet_settings.nats)

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        req = json.loads(msg.data)
        err = ErrorMessage(
            seq=1,
            request_id=req["request_id"],
            code=req["prompt"],
            message="scripted",
            param="p",
            retry_after_s=0.5,
        )
        # As a worker does: the request's reply_subject, else its stream subject.
        reply = req.get("reply_subject") or subjects.stream(req["request_id"])
        await nc.publish(reply, encode(err))

    await nc.subscribe(subjects.requests, cb=answer)  # core subscriber beside the stream
    async with StraitClient.from_settings(fleet_settings) as c:
        for code in get_args(ErrorCode):
            with pytest.raises(StraitError) as e:
                await c.complete(code)
            assert type(e.value) is ERROR_CLASSES[code]
            assert (e.value.code, e.value.param, e.value.retry_after_s) == (code, "p", 0.5)
    await nc.drain()


async def test_bad_input_gets_typed_errors_and_nothing_crashes(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    # Missing field: none of prompt / messages / prompt_token_ids.
    with pytest.raises(InvalidRequest) as e:
        await read_all(client.submit_raw(b'{"v": 1, "request_id": "nofield"}', "nofield"))
    assert "exactly one of" in e.value.message
    # Wrong type.
    with pytest.raises(InvalidRequest) as e:
        await read_all(client.submit_raw(b'{"request_id": "wrongtype", "prompt": 5}', "wrongtype"))
    assert "prompt" in e.value.message
    # Unknown protocol version.
    with pytest.raises(UnsupportedVersion):
        await read_all(client.submit_raw(b'{"v": 99, "request_id": "v99", "prompt": "x"}', "v99"))
    # The client checks what it builds before sending it, with the router's own rules.
    with pytest.raises(InvalidRequest) as e:
        await client.complete("x", temperature=5.0)
    assert "temperature" in e.value.message
    with pytest.raises(InvalidRequest):
        await client.complete("x", messages=[{"role": "user", "content": "both"}])
    # The fleet still serves.
    assert (await client.complete("still alive?", max_tokens=2)).usage.completion_tokens == 2


# Embedded only: it spies on the requests subject, which a team cannot subscribe to.
@pytest.mark.nats_modes("embedded")
async def test_oversized_request_is_refused_before_publishing(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    published: list[bytes] = []

    async def spy(msg) -> None:  # type: ignore[no-untyped-def]
        published.append(msg.data)

    await client.nc.subscribe(client.subjects.requests, cb=spy)
    big = "word " * (client.payload_limit() // 5 + 10)
    with pytest.raises(PayloadTooLarge) as e:
        await client.complete(big)
    assert "max_payload" in e.value.message and e.value.param == "prompt"
    small_limit = StraitClient(client.nc, prefix=client.subjects.prefix, max_payload=2048)
    with pytest.raises(PayloadTooLarge):
        await small_limit.complete("word " * 500)
    await client.complete("fits", max_tokens=1)
    await client.nc.flush()
    await asyncio.sleep(0.05)
    assert len(published) == 1  # only the request that fit
