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
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from libs.engine.tools import CallMarkupFilter
from libs.protocol import ChatMessage, StreamMessage, ToolCall
from libs.response_items import call_item, message_item, new_item_id, output_items
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError
from services.gateway.responses import FunctionChoice, ResponseCreate

_JSON = msgspec.json.Encoder()


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
    message = _MessageEvents(ev, out)
    reason = "stop"
    async for d in run.deltas(first):
        piece = d.text
        if markup is not None:
            piece = markup.feed(piece)
            if d.finish_reason is not None:
                piece += markup.flush(calls_made=bool(d.tool_calls))
        # Leading white space opens no message (a tool call's answer often starts with some).
        if piece and (message.text or piece.strip() or message.item is not None):
            for line in message.add(piece):
                yield line
        if d.finish_reason is not None:
            reason = d.finish_reason
            for line in message.close():
                yield line
            for call in d.tool_calls or []:
                for line in _call_events(ev, out, call):
                    yield line
    f = run.outcome.finished
    assert f is not None
    u = f.usage
    shape.finish(reason, usage_of(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield ev(kind, response=body)


class _MessageEvents:
    """The response's message item as its text streams: added at the first piece (``add``),
    each piece a delta, done at the finish (``close``); its events as SSE lines."""

    def __init__(self, ev: EventWriter, out: list[dict[str, Any]]) -> None:
        self.ev, self.out = ev, out
        self.item: dict[str, Any] | None = None
        self.text = ""

    def add(self, piece: str) -> list[bytes]:
        lines = self._open() if self.item is None else []
        assert self.item is not None
        self.text += piece
        lines.append(
            self.ev(
                "response.output_text.delta",
                item_id=self.item["id"],
                output_index=self.out.index(self.item),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return lines

    def _open(self) -> list[bytes]:
        msg = self.item = message_item(new_item_id("msg"), "", "in_progress")
        msg["content"] = []
        self.out.append(msg)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        idx = len(self.out) - 1
        return [
            self.ev("response.output_item.added", output_index=idx, item=msg),
            self.ev(
                "response.content_part.added",
                item_id=msg["id"],
                output_index=idx,
                content_index=0,
                part=part,
            ),
        ]

    def close(self) -> list[bytes]:
        msg, ev = self.item, self.ev
        if msg is None:
            return []
        idx = self.out.index(msg)
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        msg["content"] = [part]
        msg["status"] = "completed"
        where = {"item_id": msg["id"], "output_index": idx, "content_index": 0}
        return [
            ev("response.output_text.done", **where, text=self.text, logprobs=[]),
            ev("response.content_part.done", **where, part=part),
            ev("response.output_item.done", output_index=idx, item=msg),
        ]


def _call_events(ev: EventWriter, out: list[dict[str, Any]], call: ToolCall) -> list[bytes]:
    """One function call of the answer as its item's events: added, its arguments (one delta,
    the call is whole when it comes), done."""
    item = call_item(new_item_id("fc"), call, "in_progress")
    item["arguments"] = ""
    out.append(item)
    idx = len(out) - 1
    lines = [
        ev("response.output_item.added", output_index=idx, item=item),
        ev(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=idx,
            delta=call.arguments,
        ),
    ]
    item["arguments"], item["status"] = call.arguments, "completed"
    return [
        *lines,
        ev(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=idx,
            name=call.name,
            arguments=call.arguments,
        ),
        ev("response.output_item.done", output_index=idx, item=item),
    ]


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
