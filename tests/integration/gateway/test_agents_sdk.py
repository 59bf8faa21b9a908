"""The OpenAI Agents SDK (``openai-agents``) against the gateway on FAKE workers: an agent with
one function tool, run on the SDK's default Responses model (whole and streamed) and on its
chat-completions model. The first turn forces the tool (the FAKE worker answers a forced call
with empty arguments); the SDK runs the tool, sends its output back, and the second turn's
answer ends with "stop" (``fake_engine.answer_words``), which the agent takes as its final
output. Tracing is off: nothing leaves the machine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import agents
import pytest
from openai import AsyncOpenAI

from bench.support.fleet import GatewayFleet
from libs.db.keys import ensure_dev_key
from libs.settings import Settings

pytestmark = pytest.mark.integration

READING = "18 C and dry in Lima"
ANSWER_WORDS = 6


@pytest.fixture(autouse=True)
def no_tracing() -> Iterator[None]:
    """The SDK exports traces to OpenAI by default: off for these tests (no internet here)."""
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def weather_agent(model: Any, calls: list[str]) -> Any:
    @agents.function_tool
    def station_reading() -> str:
        """The latest reading of the weather station in Lima."""
        calls.append("station_reading")
        return READING

    return agents.Agent(
        name="forecaster",
        instructions="Answer with the station's reading.",
        model=model,
        tools=[station_reading],
        # Forced on the first turn; the SDK resets it to auto once the tool has run.
        model_settings=agents.ModelSettings(tool_choice="station_reading", max_tokens=32),
    )


def assert_round_trip(result: Any, calls: list[str]) -> str:
    """One tool call, its output, then the final message; returns the final text."""
    assert calls == ["station_reading"]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.new_items[1].output == READING
    final = result.final_output
    assert isinstance(final, str) and len(final.split()) == ANSWER_WORDS
    assert agents.ItemHelpers.text_message_output(result.new_items[2]) == final
    return final


async def test_agent_on_the_responses_model(gw_settings: Settings) -> None:
    gw_settings.fake_engine.answer_words = ANSWER_WORDS
    key = await ensure_dev_key(gw_settings)
    run_config = agents.RunConfig(tracing_disabled=True)
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with AsyncOpenAI(
            base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20
        ) as client:
            model = agents.OpenAIResponsesModel(model="auto", openai_client=client)

            calls: list[str] = []
            result = await agents.Runner.run(
                weather_agent(model, calls), "Weather in Lima?", run_config=run_config
            )
            final = assert_round_trip(result, calls)
            # The second turn carried the tool's output to the model: its stored input says so.
            last = await client.responses.retrieve(result.last_response_id)
            assert last.output_text == final and last.status == "completed"
            items = await client.responses.input_items.list(result.last_response_id)
            outputs = [i for i in items.data if i.type == "function_call_output"]
            assert [o.output for o in outputs] == [READING]  # type: ignore[union-attr]

            # Server-side state: a follow-up run sends only its new items, chained by
            # previous_response_id from turn to turn (the tool's output rides on the stored call).
            calls = []
            follow = await agents.Runner.run(
                weather_agent(model, calls),
                "And now?",
                run_config=run_config,
                previous_response_id=result.last_response_id,
            )
            assert_round_trip(follow, calls)
            chained = await client.responses.retrieve(follow.last_response_id)
            assert chained.previous_response_id is not None
            assert chained.usage is not None and last.usage is not None
            assert chained.usage.input_tokens > last.usage.input_tokens  # carries the first run

            # Streamed: the same loop over the SDK's stream events.
            calls = []
            streamed = agents.Runner.run_streamed(
                weather_agent(model, calls), "Weather in Lima?", run_config=run_config
            )
            deltas = [
                ev.data.delta
                async for ev in streamed.stream_events()
                if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta"
            ]
            final = assert_round_trip(streamed, calls)
            assert "".join(deltas) == final


async def test_agent_on_the_chat_completions_model(gw_settings: Settings) -> None:
    gw_settings.fake_engine.answer_words = ANSWER_WORDS
    key = await ensure_dev_key(gw_settings)
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with AsyncOpenAI(
            base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20
        ) as client:
            model = agents.OpenAIChatCompletionsModel(model="auto", openai_client=client)
            calls: list[str] = []
            result = await agents.Runner.run(
                weather_agent(model, calls),
                "Weather in Lima?",
                run_config=agents.RunConfig(tracing_disabled=True),
            )
            assert_round_trip(result, calls)
