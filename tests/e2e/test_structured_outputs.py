"""Structured outputs and tool calls on the real fleet and the real default model (SmolLM2-135M),
with the official ``openai`` SDK as the client: every constrained answer parses and validates,
unconstrained answers batched beside them keep their tokens, forced tool calls are valid (also
streamed), and fields Strait does not honour are refused with a 400 naming them."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from bench.support.procs import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLEET = """
[gateway]
auth_enabled = false
response_cache_enabled = false
[engine]
kv_cache_bytes = 134217728
max_num_seqs = 32
[[pools]]
name = "default"
model = "smollm2-135m-instruct"
backend = "engine"
"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "country": {"enum": ["France", "Peru", "Japan", "Norway"]},
    },
    "required": ["name", "age", "country"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
MOODS = ["happy", "sad", "curious"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 32}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class City(BaseModel):
    name: str = Field(max_length=32)
    country: Literal["France", "Peru", "Japan", "Norway"]
    population_millions: int = Field(ge=0, le=50)


def fleet(tmp: Path, nats_url: str, model_dir: Path, mode: str) -> ProcessFleet:
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": "structured.v1",
        "STRAIT_MODELS__DIR": str(model_dir.parent.resolve()),
    }
    workers: list[dict[str, str]] = [{}]
    extra: list[tuple[str, str, dict[str, str]]] = []
    if mode == "disaggregated":
        workers = [{"STRAIT_WORKER__ROLE": "decode"}]
        extra = [("prefill", "prefill", {"STRAIT_WORKER__WORKER_ID": "p0"})]
    return ProcessFleet(
        tmp,
        nats_url,
        FLEET + f'mode = "{mode}"\n',
        env=env,
        workers=workers,
        extra_services=extra,
        ready_timeout_s=180,
    )


def mixed_requests() -> list[tuple[str, dict[str, Any]]]:
    """32 chat requests: a quarter each JSON schema, regex, choice, and none."""
    topics = ["a pilot", "a chef", "a poet", "a sailor", "a doctor", "a farmer", "a judge", "a boy"]
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(32):
        topic = topics[i % len(topics)]
        kind = ["json", "regex", "choice", "none"][i % 4]
        body: dict[str, Any] = {"max_tokens": 64, "temperature": 0}
        if kind == "json":
            body["messages"] = [{"role": "user", "content": f"Describe {topic} as JSON."}]
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            }
        elif kind == "regex":
            body["messages"] = [{"role": "user", "content": f"When was {topic} born?"}]
            body["extra_body"] = {"structured_outputs": {"regex": DATE}}
        elif kind == "choice":
            body["messages"] = [{"role": "user", "content": f"How does {topic} feel?"}]
            body["extra_body"] = {"structured_outputs": {"choice": MOODS}}
        else:
            body["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
            body["max_tokens"] = 24
        out.append((kind, body))
    return out


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(DATE, text), text
    elif kind == "choice":
        assert text in MOODS, text


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_mixed_constrained_batch(tmp_path: Path, nats_url: str, smollm2: Path, mode: str) -> None:
    """32 concurrent mixed requests, staggered: every constrained answer validates; the
    unconstrained ones equal the same requests sent alone (no constrained neighbours)."""
    from openai import AsyncOpenAI

    requests = mixed_requests()
    with fleet(tmp_path, nats_url, smollm2, mode) as f:
        client = AsyncOpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0)

        async def ask(i: int, body: dict[str, Any]) -> tuple[str, str | None]:
            await asyncio.sleep(0.05 * i)
            r = await client.chat.completions.create(model="auto", **body)
            return r.choices[0].message.content or "", r.choices[0].finish_reason

        async def run() -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]]]:
            try:
                mixed = await asyncio.gather(*(ask(i, b) for i, (_, b) in enumerate(requests)))
                alone = [await ask(0, b) for k, b in requests if k == "none"]
                return list(mixed), alone
            finally:
                await client.close()

        mixed, alone = asyncio.run(run())
    plain = [m for (k, _), m in zip(requests, mixed, strict=True) if k == "none"]
    assert plain == alone
    for (kind, _), (text, reason) in zip(requests, mixed, strict=True):
        if kind != "none":
            assert reason == "stop", (kind, text)
            check(kind, text)


def test_sdk_parse_tools_and_refusals(tmp_path: Path, nats_url: str, smollm2: Path) -> None:
    from openai import AsyncOpenAI, BadRequestError

    with fleet(tmp_path, nats_url, smollm2, "aggregated") as f:
        client = AsyncOpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]

        async def run() -> None:
            try:
                # The SDK's parse: a Pydantic model as the response format.
                parsed = await client.chat.completions.parse(
                    model="auto",
                    messages=[{"role": "user", "content": "Describe Paris."}],
                    response_format=City,
                    max_tokens=80,
                    temperature=0,
                )
                assert isinstance(parsed.choices[0].message.parsed, City)

                # json_object: any JSON object.
                r = await client.chat.completions.create(
                    model="auto",
                    messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
                    response_format={"type": "json_object"},
                    max_tokens=96,
                    temperature=0,
                )
                if r.choices[0].finish_reason == "stop":
                    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)

                # Forced calls: required (parallel allowed) and a named function.
                for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                    r = await client.chat.completions.create(
                        model="auto",
                        messages=ask,
                        tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
                        tool_choice=choice,  # type: ignore[arg-type]
                        max_tokens=96,
                        temperature=0,
                    )
                    c = r.choices[0]
                    assert c.finish_reason == "tool_calls", c
                    assert c.message.tool_calls and c.message.content is None
                    for call in c.message.tool_calls:
                        tool = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
                        jsonschema.validate(
                            json.loads(call.function.arguments), tool["function"]["parameters"]
                        )
                        assert call.id.startswith("call_")
                    if isinstance(choice, dict):
                        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]

                # Streamed: the deltas assemble into valid calls.
                stream = await client.chat.completions.create(
                    model="auto",
                    messages=ask,
                    tools=[WEATHER_TOOL],  # type: ignore[list-item]
                    tool_choice="required",
                    max_tokens=96,
                    temperature=0,
                    stream=True,
                )
                args: dict[int, str] = {}
                names: dict[int, str] = {}
                finish = None
                content = ""
                async for chunk in stream:
                    d = chunk.choices[0].delta
                    content += d.content or ""
                    for tc in d.tool_calls or []:
                        if tc.function and tc.function.name:
                            names[tc.index] = tc.function.name
                        args[tc.index] = args.get(tc.index, "") + (
                            (tc.function.arguments or "") if tc.function else ""
                        )
                    finish = chunk.choices[0].finish_reason or finish
                assert finish == "tool_calls" and content == ""
                assert names and set(names.values()) == {"get_weather"}
                for a in args.values():
                    jsonschema.validate(json.loads(a), WEATHER_TOOL["function"]["parameters"])

                # A tool-result turn is answered.
                r = await client.chat.completions.create(
                    model="auto",
                    messages=[
                        *ask,
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {
                                        "name": "get_weather",
                                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                                    },
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
                    ],
                    tools=[WEATHER_TOOL],  # type: ignore[list-item]
                    tool_choice="none",
                    max_tokens=24,
                    temperature=0,
                )
                assert r.choices[0].message.content
                assert not r.choices[0].message.tool_calls

                # Refused with a 400 naming the field, before anything is queued.
                bad: list[tuple[dict[str, Any], str]] = [
                    ({"response_format": {"type": "xml"}}, "response_format.type"),
                    (
                        {"extra_body": {"structured_outputs": {"regex": "a("}}},
                        "structured_outputs.regex",
                    ),
                    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
                    ({"logit_bias": {"x": 1}}, "logit_bias"),
                ]
                for kw, param in bad:
                    with pytest.raises(BadRequestError) as e:
                        await client.chat.completions.create(
                            model="auto", messages=ask, max_tokens=4, **kw
                        )
                    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
            finally:
                await client.close()

        asyncio.run(run())

        # logit_bias: -100 on the greedy first token moves the answer off it.
        def first_token(extra: dict[str, Any]) -> str:
            body = {
                "model": "auto",
                "prompt": "The capital of France is",
                "max_tokens": 1,
                "temperature": 0,
                "logprobs": 0,
                **extra,
            }
            r = httpx.post(f"{f.base_url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["logprobs"]["tokens"][0])

        tok = _tokenizer(smollm2)
        greedy = first_token({})
        banned = tok.convert_tokens_to_ids(tok.tokenize(greedy))[0]
        assert first_token({"logit_bias": {str(banned): -100}}) != greedy


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
