"""``StraitClient.respond``: the Responses API's fields over NATS (instructions, items, function
tools and a ``function_call_output`` round trip, ``tool_choice``, ``text.format``,
``max_output_tokens``) against a router and a FAKE worker on a real nats-server.

The FAKE worker's prompt is the messages' ``role: content`` lines, one token a word, so its
``prompt_tokens`` shows exactly which messages the request carried."""

from __future__ import annotations

import pytest

from bench.support.fleet import InProcessFleet
from libs.client import InvalidRequest, StraitClient

pytestmark = pytest.mark.integration

INSTRUCTIONS = "Answer from the station."
QUESTION = "Weather in Lima?"
READING = "18 C and dry"
STATION = {
    "type": "function",
    "name": "station_reading",
    "description": "The latest reading of the station in Lima.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    "strict": True,
}


def words(text: str) -> int:
    return len(text.split())


async def test_function_call_round_trip_with_instructions(
    fleet: InProcessFleet, client: StraitClient
) -> None:
    fleet.workers[0].backend.settings.answer_words = 5
    first = await client.respond(
        QUESTION,
        instructions=INSTRUCTIONS,
        tools=[STATION],
        tool_choice={"type": "function", "name": "station_reading"},
        max_output_tokens=32,
    )
    assert first.status == "completed" and first.output_text == ""
    [call] = first.function_calls
    assert call["name"] == "station_reading" and call["arguments"] == "{}"
    assert call["call_id"] and [i["type"] for i in first.output] == ["function_call"]
    # system + user lines: the instructions went first, as a system message.
    assert first.usage.prompt_tokens == words(f"system: {INSTRUCTIONS}") + words(
        f"user: {QUESTION}"
    )

    follow = await client.respond(
        first.follow_up({call["call_id"]: READING}),
        instructions=INSTRUCTIONS,
        tools=[STATION],
        tool_choice="none",
        max_output_tokens=32,
    )
    # ... plus the assistant's call (no words of its own) and the tool's output.
    assert follow.usage.prompt_tokens == (
        first.usage.prompt_tokens + words("assistant:") + words(f"tool: {READING}")
    )
    assert follow.status == "completed" and not follow.function_calls
    assert [i["type"] for i in follow.output] == ["message"]
    assert words(follow.output_text) == 5
    # The output items are input items: a third turn takes the whole conversation back.
    again = await client.respond(
        [*follow.input, *follow.output, {"role": "user", "content": "Thanks"}],
        max_output_tokens=4,
    )
    assert again.usage.prompt_tokens == (
        words(f"user: {QUESTION}")
        + words("assistant:")
        + words(f"tool: {READING}")
        + words(f"assistant: {follow.output_text}")
        + words("user: Thanks")
    )


async def test_max_output_tokens_ends_incomplete(client: StraitClient) -> None:
    r = await client.respond([{"role": "user", "content": "tell me more"}], max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_reason == "max_output_tokens"
    assert r.usage.completion_tokens == 3 and words(r.output_text) == 3


async def test_text_format_reaches_the_worker_as_its_grammar(client: StraitClient) -> None:
    # The FAKE engine enforces no grammar and says so about the request's sampling.structured:
    # the format travelled on the wire (a model pool compiles it, docs/structured-outputs.md).
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}
    with pytest.raises(InvalidRequest) as e:
        await client.respond("Describe Paris.", text_format=fmt)
    assert e.value.param == "structured" and e.value.request_id
    # text is free text: no grammar, answered.
    r = await client.respond("Describe Paris.", text_format={"type": "text"}, max_output_tokens=2)
    assert r.status == "incomplete" and words(r.output_text) == 2


async def test_what_nats_cannot_take_is_refused_before_publishing(client: StraitClient) -> None:
    cases = [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "hi", "text_format": {"type": "json_schema"}}, "text.format.schema"),
        ({"input": "", "instructions": "Be brief."}, "input"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequest) as e:
            await client.respond(**kwargs)  # type: ignore[arg-type]
        assert e.value.param == param, kwargs
        assert not e.value.request_id  # never published
