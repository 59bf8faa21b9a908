"""OpenAI Responses terms in the fleet's chat terms, for both ends that speak them: the gateway's
``/v1/responses`` (``services.gateway.responses``) and the NATS client's ``respond``
(``libs.client``). docs/decisions/0027-responses-on-nats-as-client-terms.md says why the wire
carries none of them: every Responses field that makes sense without the gateway's database is
a chat field the ``GenerateRequest`` already has.

- ``input`` (text, or ``message`` / ``function_call`` / ``function_call_output`` items) and
  ``instructions`` → chat messages (:func:`input_messages`);
- a function tool as Responses writes it (``{"type": "function", "name", ...}``) → a
  ``ToolFunction`` (:func:`function_tool`); ``tool_choice`` (``"none"`` / ``"auto"`` /
  ``"required"`` / ``{"type": "function", "name"}``) → the wire's ``tool_choice`` and
  ``tool_name`` (:func:`wire_tool_choice`);
- ``text.format`` → the grammar of ``sampling.structured`` (:func:`format_structured`);
- the answer (text and calls) → output items (:func:`output_items`), which a follow-up sends
  back as input items beside its ``function_call_output``.

No pydantic, no torch: the client library imports it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from libs.protocol import ChatMessage, StructuredOutput, ToolCall, ToolChoice, ToolFunction

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
INPUT_ROLES = ("user", "assistant", "system", "developer")


class ItemError(ValueError):
    """An input item (or tool) the fleet cannot take; ``param`` names it (``input[2]``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def text_of(content: Any) -> str:
    """A message's content: text, or a list of text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be text or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise ValueError(f"content parts of type {kind!r} are not supported; only text")
        parts.append(part["text"])
    return "".join(parts)


def add_item(out: list[ChatMessage], item: Any) -> None:
    """Append one input item to the conversation ``out`` (a ``ValueError`` says what is wrong).

    Consecutive ``function_call`` items join one assistant message, as a chat model wrote them.
    """
    if not isinstance(item, Mapping):
        raise ValueError("an input item is an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(INPUT_ROLES)}")
        text = text_of(item.get("content", ""))
        out.append(ChatMessage(role="system" if role == "developer" else role, content=text))
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
            raise ValueError("a function_call item needs call_id, name and arguments (text)")
        call = ToolCall(id=call_id, name=name, arguments=args)
        last = out[-1] if out else None
        if last is not None and last.role == "assistant" and not last.tool_call_id:
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise ValueError("a function_call_output item needs the call_id it answers")
        out.append(ChatMessage(role="tool", content=text_of(output), tool_call_id=call_id))
    else:
        raise ValueError(
            f"items of type {kind!r} are not supported; use {', '.join(INPUT_ITEM_TYPES)}"
        )


def input_messages(
    input: str | Sequence[Mapping[str, Any]], instructions: str | None = None
) -> list[ChatMessage]:
    """``instructions`` (a system message first) and ``input`` as chat messages; the first item
    the fleet cannot take raises :class:`ItemError` naming it."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    if isinstance(input, str):
        return [*out, ChatMessage(role="user", content=input)] if input else out
    for i, item in enumerate(input):
        try:
            add_item(out, item)
        except ValueError as e:
            raise ItemError(f"input[{i}]", str(e)) from None
    return out


def function_tool(raw: ToolFunction | Mapping[str, Any], param: str = "tools") -> ToolFunction:
    """A function tool as Responses writes it (``type`` ``function``, flat ``name``,
    ``description``, ``parameters``, ``strict``), or already a ``ToolFunction``."""
    if isinstance(raw, ToolFunction):
        return raw
    kind = raw.get("type", "function")
    if kind != "function":
        raise ItemError(f"{param}.type", f"tools of type {kind!r} are not supported; only function")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ItemError(f"{param}.name", "a function tool needs a name")
    params = raw.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ItemError(f"{param}.parameters", "parameters is a JSON schema object")
    return ToolFunction(
        name=name, description=str(raw.get("description") or ""), parameters=dict(params)
    )


def wire_tool_choice(choice: str | Mapping[str, Any] | None) -> tuple[ToolChoice, str | None]:
    """Responses' ``tool_choice`` as the wire's (``tool_choice``, ``tool_name``): a named
    function is a ``required`` call of that function."""
    if choice is None:
        return "auto", None
    if isinstance(choice, Mapping):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ItemError("tool_choice", 'a named tool_choice is {"type": "function", "name"}')
        return "required", name
    if choice not in ("none", "auto", "required"):
        raise ItemError("tool_choice", f"{choice!r} is not one of none, auto, required")
    return choice, None  # type: ignore[return-value]  # checked just above


def format_structured(fmt: Mapping[str, Any] | None) -> StructuredOutput | None:
    """``text.format`` (``text`` / ``json_object`` / ``json_schema`` with its ``schema``) as the
    grammar the answer follows; ``text`` (or none) is free text."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json={"type": "object"})
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise ItemError("text.format.schema", "format json_schema needs a schema object")
        return StructuredOutput(json=dict(schema))
    raise ItemError("text.format.type", f"{kind!r} is not one of text, json_object, json_schema")


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


def new_item_id(prefix: str) -> str:
    """An output item's id: ``msg_…`` for a message, ``fc_…`` for a function call."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(text: str, calls: Sequence[ToolCall] | None) -> list[dict[str, Any]]:
    """An answer's output items: its text as one ``message`` (when there is text), then one
    ``function_call`` per call."""
    out = [message_item(new_item_id("msg"), text)] if text else []
    return out + [call_item(new_item_id("fc"), c) for c in calls or []]
