"""Issue 39 on the real fleet and the real default model (SmolLM2-135M, the GGUF's blocks as
``make run`` serves them), with the official ``openai`` SDK: the schema
``{"name": string, "population": integer}`` without ``additionalProperties`` and the regex
``\\d{3}-\\d{4}`` end well within ``max_tokens`` with valid output; ``chat.completions.parse``
with a pydantic model of an int, a float, a string and a list holds on 10 of 10 prompts; and
``responses.create`` plain, streamed, with a function tool and its output round trip, and with
``text.format`` JSON schema; and the OpenAI Agents SDK on its default Responses model with one
function tool (forced on the first turn: SmolLM2-135M rarely calls a tool unasked; the SDK resets
``tool_choice`` after the tool ran) -- the tool runs once with parsed arguments, its output goes
back, and the run ends with a final output (its wording is the small model's, not asserted)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Annotated

import agents
import jsonschema
import pytest
from pydantic import BaseModel, Field

from bench.support.procs import ProcessFleet
from tests.e2e.conftest import REAL_FLEET

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 128
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SUBJECTS = ["Paris", "the Moon", "a bicycle", "Mount Fuji", "the Nile", "a violin", "Lima",
            "a tiger", "the Internet", "coffee"]  # fmt: skip


def forecaster(model: object, calls: list[str]) -> agents.Agent:
    """An agent with one function tool whose argument the model must write (bounded, so the
    forced call ends)."""

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=32)]) -> str:
        """Current weather in a city.

        Args:
            city: the city's name.
        """
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    return agents.Agent(
        name="forecaster",
        instructions="Answer the weather question using the tool.",
        model=model,  # type: ignore[arg-type]
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
    )


class Facts(BaseModel):
    """NOTE: the tags' own maxLength matters: with bare strings greedy SmolLM2 wrote one tag as
    "LIMA_LIMA_LIMA_…" to max_tokens on 1 of the 10 prompts (a string is never bounded for it,
    as in vLLM and llama.cpp; docs/structured-outputs.md)."""

    name: str = Field(max_length=40)
    count: int
    score: float
    tags: list[Annotated[str, Field(max_length=24)]] = Field(max_length=4)


def test_structured_cases_and_responses_on_the_real_model(
    tmp_path: Path, nats_url: str, smollm2: Path
) -> None:
    from openai import AsyncOpenAI

    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": "agents.v1",
        "STRAIT_MODELS__DIR": str(smollm2.parent.resolve()),
        "STRAIT_ENGINE__QUANTIZATION": "gguf",
    }
    with ProcessFleet(tmp_path, nats_url, REAL_FLEET, env=env, ready_timeout_s=180) as fleet:
        client = AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)

        async def run() -> None:
            try:
                # The schema at temperature 0: two properties, then the object ends.
                r = await client.chat.completions.create(
                    model="auto",
                    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "city", "schema": CITY},
                    },
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                )
                c = r.choices[0]
                assert c.finish_reason == "stop", c.message.content
                assert r.usage is not None and r.usage.completion_tokens < MAX_TOKENS // 2
                value = json.loads(c.message.content or "")
                assert set(value) == {"name", "population"}
                jsonschema.validate(value, CITY)

                # The regex: ASCII digits, then the end.
                r = await client.chat.completions.create(
                    model="auto",
                    messages=[{"role": "user", "content": "Give me a phone number."}],
                    extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                )
                assert r.choices[0].finish_reason == "stop"
                assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content or "")

                # parse with a pydantic model of an int, a float, a string and a list: 10 of 10.
                async def parse(subject: str) -> Facts | None:
                    p = await client.chat.completions.parse(
                        model="auto",
                        messages=[{"role": "user", "content": f"Give facts about {subject}."}],
                        response_format=Facts,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                    )
                    return p.choices[0].message.parsed

                parsed = await asyncio.gather(*(parse(s) for s in SUBJECTS))
                assert all(isinstance(p, Facts) for p in parsed)

                # Responses: plain, and streamed (the same greedy text).
                plain = await client.responses.create(
                    model="auto", input="Name three rivers.", max_output_tokens=24, temperature=0
                )
                assert plain.output_text and plain.model == "smollm2-135m-instruct"
                stream = await client.responses.create(
                    model="auto",
                    input="Name three rivers.",
                    max_output_tokens=24,
                    temperature=0,
                    stream=True,
                )
                events = [ev async for ev in stream]
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                assert text == plain.output_text
                assert events[-1].type in ("response.completed", "response.incomplete")

                # A function tool, forced; its output sent back; the model answers in words.
                call_r = await client.responses.create(
                    model="auto",
                    input="What is the weather in Lima?",
                    tools=[WEATHER],  # type: ignore[list-item]
                    tool_choice="required",
                    max_output_tokens=64,
                    temperature=0,
                )
                call = call_r.output[0]
                assert call.type == "function_call" and call.name == "get_weather"
                jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
                answer = await client.responses.create(
                    model="auto",
                    previous_response_id=call_r.id,
                    input=[
                        {
                            "type": "function_call_output",
                            "call_id": call.call_id,
                            "output": "18 degrees, sunny",
                        }
                    ],
                    tools=[WEATHER],  # type: ignore[list-item]
                    tool_choice="none",
                    max_output_tokens=32,
                    temperature=0,
                )
                assert answer.output_text and answer.output[0].type == "message"

                # text.format JSON schema.
                fmt = await client.responses.create(
                    model="auto",
                    input="Describe Paris as JSON.",
                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                    max_output_tokens=MAX_TOKENS,
                    temperature=0,
                )
                assert fmt.status == "completed"
                assert set(json.loads(fmt.output_text)) == {"name", "population"}

                # The Agents SDK on its default model (OpenAIResponsesModel), one function tool.
                agents.set_tracing_disabled(True)  # its default exports traces to OpenAI
                calls: list[str] = []
                result = await agents.Runner.run(
                    forecaster(agents.OpenAIResponsesModel("auto", client), calls),
                    "What is the weather in Lima?",
                    run_config=agents.RunConfig(tracing_disabled=True),
                    max_turns=3,
                )
                assert len(calls) == 1 and 0 < len(calls[0]) <= 32, calls
                kinds = [item.type for item in result.new_items]
                assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
                assert kinds[-1] == "message_output_item", kinds
                assert result.new_items[1].output == f"18 degrees and sunny in {calls[0]}"
                assert isinstance(result.final_output, str) and result.final_output.strip()
                # The tool's output went back to the model: the last response's stored input.
                items = await client.responses.input_items.list(result.last_response_id)
                sent = [i for i in items.data if i.type == "function_call_output"]
                assert [o.output for o in sent] == [result.new_items[1].output]  # type: ignore[union-attr]
            finally:
                await client.close()

        asyncio.run(run())
