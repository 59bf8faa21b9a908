"""HTTP request bodies of the OpenAI-compatible API, and their mapping to wire messages.

No field is accepted and ignored: every field of OpenAI's chat and completions requests is
honoured, accepted without effect where that is its meaning here (``metadata``, ``user``,
``service_tier`` "auto"…, listed in ``docs/gateway.md``), or refused with a 400 naming it
(``UNSUPPORTED``); an unknown field is a 400 "Unrecognized request argument supplied", as
OpenAI answers. Invalid values raise ``ApiError(400, param=...)`` through FastAPI's validation
handler in ``errors.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from libs.engine.params import (
    BOUNDS,
    LOGIT_BIAS_KEY,
    LOGIT_BIAS_VALUE,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_PREDICTION_CHARS,
    MAX_TOOL_NAME,
    TOOL_NAME_CHARS,
)
from libs.protocol import (
    ChatMessage,
    SamplingParams,
    StructuredOutput,
    ToolCall,
    ToolChoice,
    ToolFunction,
)

# Fields of OpenAI's requests that Strait refuses when set (to anything but null / their
# no-op value), with the reason the 400 gives.
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "functions": "`functions` is deprecated and not supported; use `tools`",
    "function_call": "`function_call` is deprecated and not supported; use `tool_choice`",
    "reasoning_effort": "the served models do not reason; reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}
_NAME = f"^[{TOOL_NAME_CHARS}]{{1,{MAX_TOOL_NAME}}}$"


def bounded(name: str, default: Any = None, le: float | None = None) -> Any:
    """A body field held to the engine's bounds on its ``SamplingParams`` field ``name``
    (``libs.engine.params.BOUNDS``); ``le``: a narrower maximum of the HTTP API's own."""
    b = BOUNDS[name]
    return Field(
        default=default, ge=b.get("ge"), gt=b.get("gt"), le=b.get("le") if le is None else le
    )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted without effect (no obfuscation padding)


class PredictionPart(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """OpenAI's predicted output: text the answer is expected to repeat (docs/speculation.md)."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @model_validator(mode="after")
    def _size(self) -> Prediction:
        if len(self.text()) > MAX_PREDICTION_CHARS:
            raise ValueError(f"prediction.content is over {MAX_PREDICTION_CHARS} characters")
        return self


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way: the grammar engine allows nothing else


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsIn(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one of its fields (``json_object``: a
    ``json`` of any object)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None

    def wire(self) -> StructuredOutput:
        """The wire's constraint; that it sets exactly one kind is the engine's check
        (``libs.engine.checks``, run on the whole request by ``translate.py``)."""
        schema = self.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"json is not a JSON schema: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema object")
        if self.json_object:
            if schema is not None:
                raise ValueError("json_object is shorthand for a json schema: set one of them")
            schema = {"type": "object"}
        return StructuredOutput(
            json=schema, regex=self.regex, choice=self.choice, grammar=self.grammar
        )


class FunctionIn(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced whenever the call is forced (tool_choice)


class ToolIn(_Strict):
    type: Literal["function"]
    function: FunctionIn


class NamedFunction(_Strict):
    name: str = Field(pattern=_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class UnsupportedField(ValueError):
    """A known OpenAI field that Strait refuses; ``errors.py`` names it as the 400's param."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name = name


class _Common(_Strict):
    # The sampling fields' bounds are the engine's (libs/engine/params.py BOUNDS); the rules
    # below that name numbers of their own are the HTTP API's alone.
    model: str = Field(min_length=1)
    max_tokens: int | None = bounded("max_tokens")
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    top_k: int | None = bounded("top_k")
    min_p: float | None = bounded("min_p")
    presence_penalty: float | None = bounded("presence_penalty")
    frequency_penalty: float | None = bounded("frequency_penalty")
    # Narrower over HTTP than the engine's (> 0): at most 10.
    repetition_penalty: float | None = bounded("repetition_penalty", le=10.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = bounded("n", 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # Strait extension: scheduling class.
    priority: Literal["interactive", "standard", "batch"] = "interactive"
    # Extensions vLLM users pass: generate past EOS (benchmarks), and extra stop token ids.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    # Strait extension: speculative decoding's depth for this request, a ceiling under the
    # pool's (0: none; docs/speculation.md). Never changes the answer.
    num_speculative_tokens: int | None = bounded("num_speculative_tokens")
    # OpenAI's predicted output: speculation proposes from it first (never changes the answer).
    prediction: Prediction | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # Accepted without effect (docs/gateway.md): bookkeeping for OpenAI's own platform.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)  # prefix caching is on
    prompt_cache_retention: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    store: Literal[False] | None = None  # completions are never stored
    # Refused when set (UNSUPPORTED).
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    suffix: Any = None

    @model_validator(mode="after")
    def _refused(self) -> _Common:
        for name, why in UNSUPPORTED.items():
            if getattr(self, name, None) not in (None, ""):
                raise UnsupportedField(name, why)
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("set response_format or structured_outputs, not both")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        lo, hi = LOGIT_BIAS_VALUE["ge"], LOGIT_BIAS_VALUE["le"]
        for k, x in (v or {}).items():
            if not re.fullmatch(LOGIT_BIAS_KEY, k):
                raise ValueError(f"logit_bias keys are token ids; got {k!r}")
            if not lo <= x <= hi:
                raise ValueError(f"logit_bias values are between {lo:g} and {hi:g}; got {x}")
        return v

    def structured(self) -> StructuredOutput | None:
        """The constraint of ``response_format`` / ``structured_outputs`` (None: text)."""
        rf = self.response_format
        if rf is not None:
            if rf.type == "json_object":
                return StructuredOutput(json={"type": "object"})
            if rf.type == "json_schema":
                assert rf.json_schema is not None
                return StructuredOutput(json=rf.json_schema.schema_ or {"type": "object"})
            return None
        if self.structured_outputs is not None:
            return self.structured_outputs.wire()
        return None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def output_limit(self) -> int | None:
        return self.max_tokens

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.output_limit() or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            n=self.n,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self.logit_bias,
            structured=self.structured(),
            num_speculative_tokens=self.num_speculative_tokens,
            prediction=self.prediction.text() if self.prediction is not None else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionCallIn(_Strict):
    name: str = Field(pattern=_NAME)
    arguments: str


class ToolCallIn(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)
    refusal: str | None = None  # an earlier assistant refusal: kept as its text

    @model_validator(mode="after")
    def _shape(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def wire(self) -> ChatMessage:
        calls = None
        if self.tool_calls:
            calls = [
                ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in self.tool_calls
            ]
        text = self.text() or (self.refusal or "")
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=text,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
        )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = bounded("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = bounded("logprobs")
    tools: list[ToolIn] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None  # text is all there is

    def wire_tools(self) -> tuple[list[ToolFunction] | None, ToolChoice, str | None]:
        """(tools, tool_choice, forced function name) of the GenerateRequest. Whether they fit
        together is the engine's check (``libs.engine.checks``); a tool_choice other than
        "none" given without tools goes on as "required", which that check refuses (OpenAI
        allows tool_choice only with tools)."""
        choice = self.tool_choice
        if not self.tools:
            return None, "auto" if choice in (None, "none") else "required", None
        tools = [
            ToolFunction(
                name=t.function.name,
                description=t.function.description or "",
                parameters=t.function.parameters or {"type": "object", "properties": {}},
            )
            for t in self.tools
        ]
        if isinstance(choice, NamedToolChoice):
            return tools, "required", choice.function.name
        return tools, choice or "auto", None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wire_messages(self) -> list[ChatMessage]:
        return [m.wire() for m in self.messages]

    def logprobs_n(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field()
    # OpenAI's legacy completions allow at most 5 alternatives (the engine: 20).
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False  # echoing the prompt back is not supported
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("a batch of prompts is not supported; send one prompt per request")
        return v

    def logprobs_n(self) -> int | None:
        return self.logprobs
