"""The gateway's one mapping from the engine's field names to the OpenAI body's, and the engine's
check on every request the gateway translates."""

from __future__ import annotations

import pytest

from libs.protocol import GenerateRequest
from services.gateway.errors import ApiError
from services.gateway.fields import OpenAIFields, checked

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("fields", "param", "openai"),
    [
        (OpenAIFields("chat"), "structured.regex", "structured_outputs.regex"),
        (OpenAIFields("chat"), "structured", "structured_outputs"),
        (OpenAIFields("chat", response_format=True), "structured.json", "response_format"),
        (OpenAIFields("text", response_format=True), "structured", "response_format"),
        (OpenAIFields("responses"), "structured.json", "text.format"),
        (OpenAIFields("chat"), "tool_name", "tool_choice"),
        (OpenAIFields("text"), "prompt_token_ids", "prompt"),
        (OpenAIFields("responses"), "messages", "input"),
        (OpenAIFields("chat"), "messages", "messages"),
        (OpenAIFields("chat"), "logit_bias", "logit_bias"),
        (OpenAIFields("chat"), None, None),
    ],
)
def test_engine_params_name_the_body_field(
    fields: OpenAIFields, param: str | None, openai: str | None
) -> None:
    assert fields.of(param) == openai


def test_checked_refuses_with_the_body_field() -> None:
    req = GenerateRequest(request_id="r", prompt="x", tool_name="f")
    with pytest.raises(ApiError) as e:
        checked(req, OpenAIFields("chat"))
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_request", "tool_choice")
    ok = GenerateRequest(request_id="r", prompt="x")
    assert checked(ok, OpenAIFields("text")) is ok
