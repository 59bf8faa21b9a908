"""The engine's one input check (libs/engine/checks.py): each rule refuses with its code and the
engine's name of the field, and every path runs it (the wire's validate_request, the fake
backend's prepare). No model: these rules need none, or only its sizes."""

from __future__ import annotations

from typing import Any

import pytest

from libs.backend.fake import FAKE_VOCAB, FakeBackend
from libs.engine.checks import (
    check_kv_fits,
    check_logit_bias,
    check_prompt,
    check_prompt_chars,
    check_request,
)
from libs.engine.errors import BackendError
from libs.engine.params import ChatMessage, SamplingParams, StructuredOutput, ToolFunction
from libs.protocol import GenerateRequest, ProtocolError, validate_request
from libs.settings import FakeEngineSettings

pytestmark = pytest.mark.unit

F = ToolFunction(name="f")


def _refusal(**kw: Any) -> tuple[str, str | None]:
    args: dict[str, Any] = {
        "prompt": "hi",
        "prompt_token_ids": None,
        "messages": None,
        "sampling": SamplingParams(),
    }
    with pytest.raises(BackendError) as e:
        check_request(**{**args, **kw})
    return e.value.code, e.value.param


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"prompt": None}, None),
        ({"messages": [ChatMessage("user", "x")]}, None),
        ({"prompt": None, "messages": []}, "messages"),
        ({"sampling": SamplingParams(structured=StructuredOutput())}, "structured"),
        (
            {"sampling": SamplingParams(structured=StructuredOutput(regex="a", choice=["b"]))},
            "structured",
        ),
        ({"tools": [F, F]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [F], "tool_name": "g"}, "tool_name"),
    ],
)
def test_request_rules_name_the_engines_field(kw: dict[str, Any], param: str | None) -> None:
    assert _refusal(**kw) == ("invalid_request", param)


def test_a_well_formed_request_passes() -> None:
    check_request(
        prompt=None,
        prompt_token_ids=None,
        messages=[ChatMessage("user", "x")],
        sampling=SamplingParams(structured=StructuredOutput(regex="a")),
        tools=[F],
        tool_choice="required",
        tool_name="f",
    )


def test_the_wire_runs_the_same_check() -> None:
    req = GenerateRequest(request_id="r", prompt="x", tools=[F, F])
    with pytest.raises(ProtocolError) as e:
        validate_request(req)
    assert (e.value.code, str(e.value)) == ("invalid_request", "tools must have distinct names")


def test_prompt_rules() -> None:
    def refused(*args: Any) -> tuple[str, str | None]:
        with pytest.raises(BackendError) as e:
            check_prompt(*args)
        return e.value.code, e.value.param

    assert refused([], 4, 100, 50, "messages") == ("invalid_request", "messages")
    assert refused([1, 50], 4, 100, 50, "prompt") == ("invalid_request", "prompt_token_ids")
    assert refused([1] * 97, 4, 100, 50, "prompt") == ("context_length_exceeded", "prompt")
    check_prompt([1] * 96, 4, 100, 50, "prompt")  # exactly the context: fits
    with pytest.raises(BackendError) as e:
        check_prompt_chars(4 * 97, 4, 4, 100, "messages")  # >= 97 tokens whatever they are
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    check_prompt_chars(4 * 96 + 3, 4, 4, 100, "prompt")
    with pytest.raises(BackendError) as e:
        check_logit_bias(SamplingParams(logit_bias={"50": 1.0}), 50)
    assert e.value.param == "logit_bias"
    with pytest.raises(BackendError) as e:
        check_kv_fits(33, 4, 8)  # 9 blocks of 4 needed, 8 held
    assert e.value.code == "context_length_exceeded"
    check_kv_fits(32, 4, 8)


def test_the_fake_backend_runs_the_same_checks() -> None:
    fake = FakeBackend(FakeEngineSettings(max_model_len=64))

    def refused(**kw: Any) -> tuple[str, str | None]:
        args: dict[str, Any] = {"prompt": None, "prompt_token_ids": None, "messages": None}
        with pytest.raises(BackendError) as e:
            fake.prepare(**{**args, **kw})
        return e.value.code, e.value.param

    sp = SamplingParams(max_tokens=8)
    assert refused(prompt_token_ids=[FAKE_VOCAB], sampling=sp) == (
        "invalid_request",
        "prompt_token_ids",
    )
    assert refused(prompt_token_ids=[], sampling=sp) == ("invalid_request", "prompt")
    long = [ChatMessage("user", "w " * 60)]
    assert refused(messages=long, sampling=sp) == ("context_length_exceeded", "messages")
    constrained = SamplingParams(structured=StructuredOutput(regex="a"))
    assert refused(prompt="x", sampling=constrained) == ("invalid_request", "structured")
