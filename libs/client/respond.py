"""The Responses API's request fields for NATS clients: ``StraitClient.respond``.

A response over NATS is one ``GenerateRequest`` built from Responses terms by
``libs.response_items`` (the same translation as the gateway's ``/v1/responses``): ``input``
(text or message / ``function_call`` / ``function_call_output`` items) and ``instructions`` as
``messages``, Responses-shaped function ``tools`` and ``tool_choice`` as the wire's tools,
``text_format`` as ``sampling.structured``, ``max_output_tokens`` as ``sampling.max_tokens``.
Its answer comes back as a :class:`Response` whose ``output`` items a follow-up sends back as
input beside its ``function_call_output`` items. What the gateway keeps in its database
(``store``, ``previous_response_id``, ``background``) has no NATS form: the caller holds the
conversation (docs/decisions/0027-responses-on-nats-as-client-terms.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from libs.client.errors import InvalidRequest
from libs.engine.tools import content_before_calls
from libs.protocol import Finished, Priority, ToolCall, ToolFunction, Usage
from libs.response_items import (
    ItemError,
    format_structured,
    function_tool,
    input_messages,
    output_items,
    wire_tool_choice,
)

InputItems = str | Sequence[Mapping[str, Any]]
ToolChoiceLike = Literal["none", "auto", "required"] | Mapping[str, Any] | None


class ResponseOptions(TypedDict, total=False):
    """The other request fields ``respond`` takes (as ``generate``'s of the same names)."""

    model: str
    temperature: float
    top_p: float
    seed: int | None
    parallel_tool_calls: bool
    priority: Priority
    user: str | None
    request_id: str
    want_route: bool
    first_token_timeout_s: float
    idle_timeout_s: float


def request_options(
    input: InputItems,
    instructions: str | None,
    tools: Sequence[ToolFunction | Mapping[str, Any]] | None,
    tool_choice: ToolChoiceLike,
    text_format: Mapping[str, Any] | None,
    max_output_tokens: int | None,
) -> dict[str, Any]:
    """The ``generate`` options of these Responses fields (``InvalidRequest`` names a bad one)."""
    try:
        messages = input_messages(input, instructions)
        wire_tools = [function_tool(t, f"tools[{i}]") for i, t in enumerate(tools or [])]
        choice, name = wire_tool_choice(tool_choice)
        structured = format_structured(text_format)
    except ItemError as e:
        raise InvalidRequest(str(e), param=e.param) from None
    if not any(m.role != "system" for m in messages):
        raise InvalidRequest("input must not be empty", param="input")
    opts: dict[str, Any] = {"messages": messages, "tool_choice": choice, "tool_name": name}
    if wire_tools:
        opts["tools"] = wire_tools
    if structured is not None:
        opts["structured"] = structured
    if max_output_tokens is not None:
        opts["max_tokens"] = max_output_tokens
    return opts


@dataclass
class Response:
    """A response's answer, in the Responses API's terms.

    ``output``: a ``message`` item (its text) and/or ``function_call`` items (``call_id``,
    ``name``, ``arguments`` as JSON text), shaped as Responses input items. ``status``:
    ``completed``, or ``incomplete`` when ``max_output_tokens`` cut it
    (``incomplete_reason`` ``max_output_tokens``).
    """

    request_id: str
    status: Literal["completed", "incomplete"]
    output: list[dict[str, Any]]
    finished: Finished
    incomplete_reason: str | None = None
    input: list[dict[str, Any]] = field(default_factory=list)

    @property
    def output_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )

    @property
    def function_calls(self) -> list[dict[str, Any]]:
        return [item for item in self.output if item["type"] == "function_call"]

    @property
    def usage(self) -> Usage:
        return self.finished.usage

    def follow_up(self, outputs: Mapping[str, str]) -> list[dict[str, Any]]:
        """The next request's ``input``: this one's input and output items, then one
        ``function_call_output`` per ``call_id`` in ``outputs`` (the tools' results)."""
        done = [
            {"type": "function_call_output", "call_id": call_id, "output": text}
            for call_id, text in outputs.items()
        ]
        return [*self.input, *self.output, *done]


def input_items(input: InputItems) -> list[dict[str, Any]]:
    """``input`` as a list of items (text is one user message)."""
    if isinstance(input, str):
        return [{"type": "message", "role": "user", "content": input}] if input else []
    return [dict(item) for item in input]


def response_of(
    request_id: str,
    input: InputItems,
    text: str,
    reason: str | None,
    calls: Sequence[ToolCall] | None,
    finished: Finished,
) -> Response:
    """A finished request's answer as a :class:`Response`."""
    cut = reason == "length"
    if calls:
        text = content_before_calls(text) or ""
    return Response(
        request_id=request_id,
        status="incomplete" if cut else "completed",
        output=output_items(text, calls),
        finished=finished,
        incomplete_reason="max_output_tokens" if cut else None,
        input=input_items(input),
    )
