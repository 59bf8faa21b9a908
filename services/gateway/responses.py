"""OpenAI's Responses API (``/v1/responses``) over the same fleet as chat completions.

A response is a chat completion underneath: ``ResponseCreate.messages`` turns ``instructions``,
the stored conversation of ``previous_response_id`` and the ``input`` (text, or message,
``function_call`` and ``function_call_output`` items) into chat messages; ``tools`` (function
tools), ``tool_choice``, ``text.format`` and the sampling fields map onto the
``GenerateRequest`` as chat's do. ``app.py`` admits and runs it (``begin``, the same key, rate
limits, backpressure and ledger path as chat; never the response cache). The answer is shaped
here: a ``response`` object with ``message`` and ``function_call`` output items, or the SDK's
stream events (``response.created`` … ``response.output_text.delta`` …
``response.function_call_arguments.delta`` … ``response.completed`` / ``response.incomplete``,
``error``). With ``store`` (OpenAI's default) the response and its conversation are kept per
API key (``libs.db.responses``) for ``GET``, ``DELETE`` and a follow-up's
``previous_response_id``; with ``background`` it runs after the create has returned
(``background.py``). No field is accepted and ignored: see ``UNSUPPORTED_RESPONSE_FIELDS``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from pydantic import Field, model_validator

from libs.protocol import (
    ChatMessage,
    StreamMessage,
    StructuredOutput,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from libs.response_items import (
    ItemError,
    call_item,
    format_structured,
    input_messages,
    message_item,
    new_item_id,
    output_items,
)
from libs.tools import CallMarkupFilter
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError
from services.gateway.schemas import (
    _NAME,
    StreamOptions,
    UnsupportedField,
    _Strict,
)

_JSON = msgspec.json.Encoder()

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
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
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
    priority: Literal["interactive", "batch"] = "interactive"
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


# ---------------------------------------------------------------- shaping the answer


def usage_of(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class ResponseShape:
    """The ``response`` object of one request, filled in as its answer arrives."""

    def __init__(self, body: ResponseCreate, response_id: str, model: str, store: bool) -> None:
        fmt = body.text.format if body.text is not None and body.text.format else None
        self.body: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": body.background is True,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"},
                "verbosity": "medium",
            },
            "tool_choice": (
                body.tool_choice.model_dump()
                if isinstance(body.tool_choice, FunctionChoice)
                else body.tool_choice or "auto"
            ),
            "tools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description or None,
                    "parameters": t.parameters,
                    "strict": True,
                }
                for t in body.function_tools()
            ],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def finish(self, reason: str, usage: dict[str, Any]) -> None:
        self.body["usage"] = usage
        if reason == "length":
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.body["status"] = "completed"

    def history_messages(self) -> list[ChatMessage]:
        """This response's output as chat messages (for a follow-up's history)."""
        text, calls = "", []
        for item in self.body["output"]:
            if item["type"] == "message":
                text += item["content"][0]["text"]
            else:
                calls.append(
                    ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])
                )
        return [ChatMessage(role="assistant", content=text, tool_calls=calls or None)]


def whole_response(shape: ResponseShape, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion (``CompletionRun.collect``) as the response's output."""
    choice = chat["choices"][0]
    msg = choice["message"]
    calls = [
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in msg.get("tool_calls") or []
    ]
    output = output_items(msg.get("content") or "", calls)
    shape.body["model"] = chat["model"]
    shape.body["output"] = output
    u = chat["usage"]
    usage = usage_of(
        u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    )
    shape.finish(choice["finish_reason"], usage)
    return shape.body


class EventWriter:
    """The SDK's stream events as SSE lines (``event:`` + ``data:``), numbered."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _JSON.encode(data) + b"\n\n"


async def response_events(
    shape: ResponseShape, run: CompletionRun, first: StreamMessage, filtered: bool
) -> AsyncIterator[bytes]:
    """Stream events from the run's token deltas (``CompletionRun.deltas``); an error after
    the start is an ``error`` event and ``response.failed``. ``filtered``: tool calls are
    reported, so text that may start a call's markup is held back. The caller closes the run."""
    ev = EventWriter()
    try:
        async for line in _events(ev, shape, run, first, filtered):
            yield line
    except ApiError as e:
        yield ev("error", code=e.code, message=e.message, param=e.param)
        shape.body["status"] = "failed"
        shape.body["error"] = {"code": e.code or "server_error", "message": e.message}
        yield ev("response.failed", response=shape.body)


async def _events(
    ev: EventWriter, shape: ResponseShape, run: CompletionRun, first: StreamMessage, filtered: bool
) -> AsyncIterator[bytes]:
    body = shape.body
    yield ev("response.created", response=body)
    yield ev("response.in_progress", response=body)
    out: list[dict[str, Any]] = body["output"]
    markup = CallMarkupFilter() if filtered else None
    msg: dict[str, Any] | None = None
    text = ""
    reason = "stop"

    def open_message() -> list[bytes]:
        nonlocal msg
        msg = message_item(new_item_id("msg"), "", "in_progress")
        msg["content"] = []
        out.append(msg)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        idx = len(out) - 1
        return [
            ev("response.output_item.added", output_index=idx, item=msg),
            ev(
                "response.content_part.added",
                item_id=msg["id"],
                output_index=idx,
                content_index=0,
                part=part,
            ),
        ]

    def close_message() -> list[bytes]:
        assert msg is not None
        idx = out.index(msg)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        msg["content"] = [part]
        msg["status"] = "completed"
        return [
            ev(
                "response.output_text.done",
                item_id=msg["id"],
                output_index=idx,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            ev(
                "response.content_part.done",
                item_id=msg["id"],
                output_index=idx,
                content_index=0,
                part=part,
            ),
            ev("response.output_item.done", output_index=idx, item=msg),
        ]

    async for d in run.deltas(first):
        piece = d.text
        if markup is not None:
            piece = markup.feed(piece)
            if d.finish_reason is not None:
                piece += markup.flush(calls_made=bool(d.tool_calls))
        if piece and (text or piece.strip() or msg is not None):
            if msg is None:
                for line in open_message():
                    yield line
            assert msg is not None
            text += piece
            yield ev(
                "response.output_text.delta",
                item_id=msg["id"],
                output_index=out.index(msg),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        if d.finish_reason is not None:
            reason = d.finish_reason
            if msg is not None:
                for line in close_message():
                    yield line
            for call in d.tool_calls or []:
                item = call_item(new_item_id("fc"), call, "in_progress")
                item["arguments"] = ""
                out.append(item)
                idx = len(out) - 1
                yield ev("response.output_item.added", output_index=idx, item=item)
                yield ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=idx,
                    delta=call.arguments,
                )
                item["arguments"], item["status"] = call.arguments, "completed"
                yield ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    name=call.name,
                    arguments=call.arguments,
                )
                yield ev("response.output_item.done", output_index=idx, item=item)
    f = run.outcome.finished
    assert f is not None
    u = f.usage
    shape.finish(reason, usage_of(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield ev(kind, response=body)


def input_items(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored conversation (chat messages as stored) as Responses input items, oldest first."""
    items: list[dict[str, Any]] = []
    for i, raw in enumerate(history):
        m = msgspec.convert(raw, ChatMessage)
        if m.role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{i}",
                    "call_id": m.tool_call_id,
                    "output": m.content,
                    "status": "completed",
                }
            )
            continue
        if m.content or not m.tool_calls:
            kind = "output_text" if m.role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": m.content}
            if kind == "output_text":
                part["annotations"] = []
            items.append(
                {
                    "type": "message",
                    "id": f"msg_{i}",
                    "role": m.role,
                    "content": [part],
                    "status": "completed",
                }
            )
        for k, call in enumerate(m.tool_calls or []):
            items.append(call_item(f"fc_{i}_{k}", call))
    return items
