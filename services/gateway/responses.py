"""OpenAI's Responses API (``/v1/responses``) over the same fleet as chat completions: the
request.

A response is a chat completion underneath: ``ResponseCreate.messages`` turns ``instructions``,
the stored conversation of ``previous_response_id`` and the ``input`` (text, or message,
``function_call`` and ``function_call_output`` items) into chat messages; ``tools`` (function
tools), ``tool_choice``, ``text.format`` and the sampling fields map onto the
``GenerateRequest`` as chat's do. ``routes/responses.py`` admits and runs it (the same key, rate
limits, backpressure and ledger path as chat; never the response cache) and
``response_output.py`` shapes the answer. With ``store`` (OpenAI's default) the response and its
conversation are kept per API key (``libs.db.responses``) for ``GET``, ``DELETE`` and a
follow-up's ``previous_response_id``; with ``background`` it runs after the create has returned
(``background.py``). No field is accepted and ignored: see ``UNSUPPORTED_RESPONSE_FIELDS``.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from libs.protocol import (
    ChatMessage,
    StructuredOutput,
    ToolChoice,
    ToolFunction,
)
from libs.response_items import ItemError, format_structured, input_messages
from services.gateway.errors import ApiError
from services.gateway.schemas import (
    _NAME,
    StreamOptions,
    UnsupportedField,
    _Strict,
    bounded,
)

# Fields of OpenAI's Responses request that Strait refuses when set (to anything but null / an
# empty value / their no-op value), with the reason the 400 gives.
UNSUPPORTED_RESPONSE_FIELDS: dict[str, str] = {
    "conversation": "conversations are not supported; use previous_response_id",
    "include": "no extra output data (include) is available",
    "max_tool_calls": "max_tool_calls is not supported",
    "prompt": "prompt templates are not supported",
    "reasoning": "the served models do not reason; reasoning is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "context_management": "context_management is not supported",
}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced whenever the call is forced (tool_choice)


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # enforced either way

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("format json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one verbosity there is


class ResponseCreate(_Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(default="")
    instructions: str | None = None
    max_output_tokens: int | None = bounded("max_tokens")
    temperature: float | None = bounded("temperature")
    top_p: float | None = bounded("top_p")
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    user: str | None = Field(default=None, max_length=256)
    # Strait extension: scheduling class.
    priority: Literal["interactive", "standard", "batch"] = "interactive"
    # Accepted without effect, as on chat: bookkeeping for OpenAI's own platform.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)  # prefix caching is on
    prompt_cache_retention: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # a prompt too long is a 413, never cut
    # Run after the create returns (services.gateway.background); not with stream, not unstored.
    background: bool | None = None
    # Refused when set (UNSUPPORTED_RESPONSE_FIELDS).
    conversation: Any = None
    include: list[str] | None = None
    max_tool_calls: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: int | None = None
    context_management: Any = None

    @model_validator(mode="after")
    def _refused(self) -> ResponseCreate:
        for name, why in UNSUPPORTED_RESPONSE_FIELDS.items():
            if getattr(self, name) not in (None, "", [], False, 0, {}):
                raise UnsupportedField(name, why)
        if self.background and self.stream:
            raise UnsupportedField(
                "stream",
                "background responses are not streamed; poll GET /v1/responses/{id}",
            )
        if self.background and self.store is False:
            raise UnsupportedField(
                "store", "background responses are stored; store cannot be false"
            )
        if isinstance(self.input, str) and not self.input and not self.previous_response_id:
            raise ValueError("input must not be empty")
        return self

    # ------------------------------------------------------------ to the fleet's terms

    def function_tools(self) -> list[ToolFunction]:
        """``tools`` as function tools; another tool type is a 400 naming it."""
        out = []
        for i, raw in enumerate(self.tools or []):
            kind = raw.get("type")
            if kind != "function":
                raise ApiError(
                    400,
                    f"tools of type {kind!r} are not supported; only function tools are",
                    "unsupported_parameter",
                    f"tools[{i}].type",
                )
            try:
                t = FunctionTool.model_validate(raw)
            except ValueError as e:
                raise ApiError(400, f"tools[{i}]: {e}", "invalid_request", f"tools[{i}]") from None
            out.append(
                ToolFunction(
                    name=t.name,
                    description=t.description or "",
                    parameters=t.parameters or {"type": "object", "properties": {}},
                )
            )
        return out

    def wire_tools(self) -> tuple[list[ToolFunction] | None, ToolChoice, str | None]:
        """(tools, tool_choice, forced function name) of the GenerateRequest. Whether they fit
        together is the engine's check (``libs.engine.checks``, run by the route); a
        tool_choice other than "none" given without tools goes on as "required", which that
        check refuses."""
        tools = self.function_tools()
        choice = self.tool_choice
        if not tools:
            return None, "required" if choice not in (None, "none") else choice or "auto", None
        if isinstance(choice, FunctionChoice):
            return tools, "required", choice.name
        return tools, choice or "auto", None

    def structured(self) -> StructuredOutput | None:
        fmt = self.text.format if self.text is not None else None
        return format_structured(fmt.model_dump(by_alias=True) if fmt is not None else None)

    def input_messages(self) -> list[ChatMessage]:
        """``input`` as chat messages (a 400 names the first item it cannot take)."""
        try:
            return input_messages(self.input)
        except ItemError as e:
            raise ApiError(400, str(e), "invalid_request", e.param) from None
