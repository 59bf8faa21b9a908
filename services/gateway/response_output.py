"""The answer of a Responses API request (``/v1/responses``; the request is ``responses.py``).

A chat completion's output shaped as OpenAI's ``response`` object (``ResponseShape``, filled in
as the answer arrives; ``whole_response`` from a collected chat completion) with ``message``
and ``function_call`` output items, or as the SDK's stream events (``response_events``:
``response.created`` … ``response.output_text.delta`` …
``response.function_call_arguments.delta`` … ``response.completed`` / ``response.incomplete``,
``error``); and a stored conversation read back as input items (``input_items``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from libs.protocol import ChatMessage, StreamMessage, ToolCall
from libs.tools import CallMarkupFilter
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError
from services.gateway.responses import FunctionChoice, ResponseCreate

_JSON = msgspec.json.Encoder()


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


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
    output: list[dict[str, Any]] = []
    if msg.get("content"):
        output.append(message_item(_item_id("msg"), msg["content"]))
    for c in msg.get("tool_calls") or []:
        f = c["function"]
        call = ToolCall(id=c["id"], name=f["name"], arguments=f["arguments"])
        output.append(call_item(_item_id("fc"), call))
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
        msg = message_item(_item_id("msg"), "", "in_progress")
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
                item = call_item(_item_id("fc"), call, "in_progress")
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
