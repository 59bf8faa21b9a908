"""``/v1/responses`` as the official ``openai`` SDK sees it, on a fleet of FAKE workers (shapes,
streaming events, function-call round trips, stored responses per key, refusals), plus
``models.retrieve`` and a named 404."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from bench.support.fleet import GatewayFleet
from libs.db.keys import ensure_dev_key
from libs.settings import Settings
from tests.integration.gateway.conftest import new_key

pytestmark = pytest.mark.integration

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def client(base: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


async def test_responses_through_the_sdk(gw_settings: Settings) -> None:
    key = await ensure_dev_key(gw_settings)
    other = await new_key(gw_settings, "other")
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c, client(base, other) as c2:
            # Plain: text in, one message out, cut by max_output_tokens.
            r = await c.responses.create(
                model="auto", input="tell me about rivers", max_output_tokens=5
            )
            assert r.object == "response" and r.id.startswith("resp_")
            assert r.model == "fake-model"
            assert r.status == "incomplete" and r.incomplete_details is not None
            assert r.incomplete_details.reason == "max_output_tokens"
            assert len(r.output_text.split()) == 5
            assert r.usage is not None and r.usage.output_tokens == 5
            assert r.output[0].type == "message" and r.store is True

            # Stored: read back by its key only, then a follow-up carries the conversation.
            got = await c.responses.retrieve(r.id)
            assert got.id == r.id and got.output_text == r.output_text
            with pytest.raises(openai.NotFoundError):
                await c2.responses.retrieve(r.id)
            follow = await c.responses.create(
                model="auto",
                input=[{"role": "user", "content": "and lakes?"}],
                previous_response_id=r.id,
                instructions="Be brief.",
                max_output_tokens=3,
            )
            assert follow.previous_response_id == r.id
            assert follow.usage is not None and r.usage is not None
            assert follow.usage.input_tokens > r.usage.input_tokens
            items = await c.responses.input_items.list(follow.id)
            texts = [i.content[0].text for i in items.data if i.type == "message"]  # type: ignore[union-attr]
            assert texts[0] == "and lakes?" and texts[-1] == "tell me about rivers"
            with pytest.raises(openai.BadRequestError) as e:
                await c2.responses.create(model="auto", input="x", previous_response_id=r.id)
            assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]

            # Streamed: the SDK's events, in order, ending with the whole response.
            stream = await c.responses.create(
                model="auto", input="rivers", max_output_tokens=4, stream=True
            )
            events = [ev async for ev in stream]
            kinds = [ev.type for ev in events]
            assert kinds[:4] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert kinds.count("response.output_text.delta") == 4
            assert kinds[-4:] == [
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
            assert [ev.sequence_number for ev in events] == list(range(len(events)))
            deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
            final = events[-1].response  # type: ignore[union-attr]
            assert final.output_text == deltas and final.usage.output_tokens == 4
            assert (await c.responses.retrieve(final.id)).output_text == deltas

            # A forced function call, its output sent back, and the answer to it.
            call_r = await c.responses.create(
                model="auto",
                input="weather in Lima?",
                tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"},
            )
            call = call_r.output[0]
            assert call.type == "function_call" and call.name == "get_weather"
            assert call.call_id.startswith("call_") and call_r.status == "completed"
            answer = await c.responses.create(
                model="auto",
                previous_response_id=call_r.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
                tools=[WEATHER],
                max_output_tokens=4,
            )
            assert answer.output[0].type == "message" and answer.output_text
            # The same round trip without storing: the items carried by the client.
            stateless = await c.responses.create(
                model="auto",
                store=False,
                input=[
                    {"role": "user", "content": "weather in Lima?"},
                    {
                        "type": "function_call",
                        "call_id": call.call_id,
                        "name": "get_weather",
                        "arguments": call.arguments,
                    },
                    {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
                ],
                max_output_tokens=4,
            )
            assert stateless.store is False and stateless.output_text
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(stateless.id)

            # Streamed call: its arguments arrive as function_call_arguments events.
            stream = await c.responses.create(
                model="auto",
                input="weather?",
                tools=[WEATHER],
                tool_choice="required",
                stream=True,
            )
            events = [ev async for ev in stream]
            kinds = [ev.type for ev in events]
            assert "response.output_text.delta" not in kinds
            assert "response.function_call_arguments.delta" in kinds
            assert kinds[-1] == "response.completed"
            assert events[-1].response.output[0].type == "function_call"  # type: ignore[union-attr]

            # Delete, then gone; a foreground response cannot be cancelled.
            with pytest.raises(openai.BadRequestError):
                await c.responses.cancel(r.id)
            deleted = await c.responses.delete(r.id)
            assert deleted is None  # the SDK returns nothing for a 200
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(r.id)

            # models.retrieve, and an OpenAI endpoint Strait does not serve.
            assert (await c.models.retrieve("fake-model")).id == "fake-model"
            with pytest.raises(openai.NotFoundError) as nf:
                await c.embeddings.create(model="auto", input="x")
            assert "Embeddings" in str(nf.value)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True, "stream": True}, "stream"),
        ({"background": True, "store": False}, "store"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0]"),
        ({"truncation": "auto"}, "truncation"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
async def test_fields_strait_cannot_honour_are_refused(
    gw_settings: Settings, extra: dict[str, Any], param: str
) -> None:
    """Validation answers before the fleet: no worker is needed."""
    gw_settings.gateway.auth_enabled = False
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app

    body = {"model": "auto", "input": "hi", **extra}
    r = TestClient(create_app(gw_settings)).post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
