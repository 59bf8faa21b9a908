"""Every OpenAI request field is honoured, accepted without effect, or refused with a 400 naming
it (the gateway's schemas, through the real FastAPI app: validation answers before any fleet);
the tool-call markup parser and the stream's hold-back filter."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from libs.engine.params import BOUNDS
from libs.engine.tools import CallMarkupFilter, ToolSpec, constraint_kind, parse_tool_calls
from libs.protocol import SamplingParams, StructuredOutput, ToolFunction
from libs.settings import Settings
from services.gateway.app import create_app
from services.gateway.schemas import UNSUPPORTED, ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.unit

CHAT = {"model": "auto", "messages": [{"role": "user", "content": "x"}]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def client() -> TestClient:
    s = Settings()
    s.gateway.auth_enabled = False
    return TestClient(create_app(s))  # no lifespan: only requests that validation refuses


def error(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize("field", sorted(set(UNSUPPORTED) - {"suffix"}))
def test_refused_chat_fields_name_themselves(client: TestClient, field: str) -> None:
    err = error(client, "/v1/chat/completions", {**CHAT, field: {"x": 1}})
    assert err["param"] == field and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"structured_outputs": {}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tools": [TOOL, TOOL]}, "tools"),
        ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities.0"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ("/v1/chat/completions", {"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ("/v1/chat/completions", {"prediction": {"type": "x", "content": "a"}}, "prediction.type"),
        ("/v1/chat/completions", {"prediction": {"type": "content"}}, "prediction.content"),
        (
            "/v1/chat/completions",
            {"prediction": {"type": "content", "content": "a" * 262_145}},
            "prediction",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, None),
        ("/v1/completions", {"prompt": "x", "tools": [TOOL]}, "tools"),
    ],
)
def test_bad_or_unknown_fields_are_400s(
    client: TestClient, path: str, extra: dict[str, Any], param: str | None
) -> None:
    base = CHAT if path.endswith("chat/completions") else {"model": "auto"}
    err = error(client, path, {**base, **extra})
    assert err["param"] == param, err


def _beyond(name: str) -> list[tuple[str, float]]:
    """(bound, a value just past it) for each bound the engine sets on ``name``."""
    b = BOUNDS[name]
    out: list[tuple[str, float]] = []
    if "ge" in b:
        out.append(("ge", b["ge"] - (1 if isinstance(b["ge"], int) else 0.5)))
    if "gt" in b:
        out.append(("gt", b["gt"]))
    if "le" in b:
        out.append(("le", b["le"] + (1 if isinstance(b["le"], int) else 0.5)))
    return out


# SamplingParams' field → (endpoint, body field, extra body) where the HTTP API takes it.
_BODY_FIELD: dict[str, tuple[str, str, dict[str, Any]]] = {
    "logprobs": ("/v1/chat/completions", "top_logprobs", {"logprobs": True}),
}


@pytest.mark.parametrize(
    ("name", "kind", "value"),
    [(name, kind, value) for name in sorted(BOUNDS) for kind, value in _beyond(name)],
)
def test_engine_bounds_hold_at_both_doors(
    client: TestClient, name: str, kind: str, value: float
) -> None:
    """One definition (libs.engine.params.BOUNDS): a value past a bound is a 400 naming the
    body's field over HTTP, and refused by the wire's SamplingParams over NATS."""
    path, field, extra = _BODY_FIELD.get(name, ("/v1/chat/completions", name, {}))
    err = error(client, path, {**CHAT, **extra, field: value})
    assert err["param"] == field, err
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({name: value}, SamplingParams)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_output_tokens", 0), ("temperature", 2.5), ("top_p", 0.0)],
)
def test_responses_bounds_are_the_engines(client: TestClient, field: str, value: float) -> None:
    err = error(client, "/v1/responses", {"model": "auto", "input": "x", field: value})
    assert err["param"] == field, err


def test_unknown_field_message_is_openais(client: TestClient) -> None:
    err = error(client, "/v1/chat/completions", {**CHAT, "frobnicate": 1})
    assert err["message"] == "Unrecognized request argument supplied: frobnicate"


def test_fields_map_onto_the_wire() -> None:
    b = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
            },
            "logit_bias": {"12": -5},
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "metadata": {"team": "x"},
            "service_tier": "auto",
            "store": False,
            "num_speculative_tokens": 0,
        }
    )
    sp = b.sampling(16, None)
    assert sp.num_speculative_tokens == 0
    assert (
        ChatCompletionRequest.model_validate(CHAT).sampling(16, None).num_speculative_tokens is None
    )
    assert sp.structured == StructuredOutput(json={"type": "object"})
    assert sp.logit_bias == {"12": -5.0}
    assert sp.prediction is None
    for content in ("def f():\n    return 1\n", [{"type": "text", "text": "def f():\n"}] * 2):
        predicted = ChatCompletionRequest.model_validate(
            {**CHAT, "prediction": {"type": "content", "content": content}}
        ).sampling(16, None)
        want = content if isinstance(content, str) else "def f():\ndef f():\n"
        assert predicted.prediction == want
    tools, choice, name = b.wire_tools()
    assert [t.name for t in tools or []] == ["get_weather"]
    assert (choice, name) == ("required", "get_weather")
    j = CompletionRequest.model_validate(
        {"model": "auto", "prompt": "x", "structured_outputs": {"json": '{"type": "array"}'}}
    )
    assert j.sampling(16, None).structured == StructuredOutput(json={"type": "array"})
    obj = CompletionRequest.model_validate(
        {"model": "auto", "prompt": "x", "response_format": {"type": "json_object"}}
    )
    assert obj.sampling(16, None).structured == StructuredOutput(json={"type": "object"})
    text = CompletionRequest.model_validate(
        {"model": "auto", "prompt": "x", "response_format": {"type": "text"}}
    )
    assert text.sampling(16, None).structured is None


def test_tool_history_travels_on_the_wire() -> None:
    b = ChatCompletionRequest.model_validate(
        {
            "model": "auto",
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
        }
    )
    m = b.wire_messages()
    assert m[1].tool_calls is not None and m[1].tool_calls[0].name == "f"
    assert m[2].role == "tool" and m[2].tool_call_id == "c1"


F = ToolFunction(name="f")
G = ToolFunction(name="g")


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "", ["f"]),
        (
            'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            "Sure.",
            ["f", "g"],
        ),
        ('<tool_call>{"name": "h", "arguments": {}}</tool_call>', None, []),  # unknown function
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, []),  # not an object
        ('<tool_call>{"name": "f", "arguments": {}', None, []),  # cut
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and more', None, []),
        ("no call at all", None, []),
    ],
)
def test_parse_tool_calls(text: str, content: str | None, names: list[str]) -> None:
    got_content, calls = parse_tool_calls(text, [F, G])
    assert [c.name for c in calls] == names
    assert got_content == (content if names else text)
    assert all(c.id.startswith("call_") for c in calls)


def test_markup_filter_holds_back_only_what_may_be_markup() -> None:
    f = CallMarkupFilter()
    assert f.feed("Hello <") == "Hello "
    assert f.feed("b>") == "<b>"  # not the markup after all
    assert f.feed(" x <tool_") == " x "
    assert f.feed('call>{"name"') == ""
    assert f.feed("...") == ""
    assert f.flush(calls_made=True) == ""
    g = CallMarkupFilter()
    g.feed("a <tool_call>broken")
    assert g.flush(calls_made=False) == "<tool_call>broken"


def test_constraint_kind_and_tool_spec() -> None:
    from libs.protocol import GenerateRequest, SamplingParams

    req = GenerateRequest(request_id="r", prompt="x")
    assert constraint_kind(req) == "none" and ToolSpec.of(req) is None
    req = GenerateRequest(
        request_id="r",
        prompt="x",
        sampling=SamplingParams(structured=StructuredOutput(regex="a")),
        tools=[F],
        tool_name="f",
    )
    spec = ToolSpec.of(req)
    assert spec is not None and spec.forced and spec.callable() == [F]
    assert constraint_kind(req) == "regex+tools"
