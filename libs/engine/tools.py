"""Tool calling: the text format of a call, the constraint that forces calls, and the parser.

A model calls tools by writing, after any text of its own, one or more

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(the Hermes / Qwen format, which their chat templates teach; for a template with no tool format,
:func:`fallback_instructions` teaches it in a system message). Who calls what:

- the worker's ``prepare`` (``libs.engine.async_engine``) renders tools into the prompt and asks
  :func:`forced_calls_lark` for the grammar when ``tool_choice`` is ``required`` or names a
  function (the grammar engine then makes the calls valid whatever the model);
- the worker's ``serve`` (``services.worker.aggregated``) keeps each choice's text and, when the
  choice ends, :func:`parse_tool_calls` turns it into ``ToolCall``s on the last ``TokenDelta``;
- the gateway holds back streamed text that may start a call (:class:`CallMarkupFilter`) and
  answers in OpenAI's shape (``message.tool_calls``, ``finish_reason: "tool_calls"``).

No torch here: the gateway imports it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libs.engine.json_schema import for_grammar
from libs.engine.params import ToolCall, ToolChoice, ToolFunction

if TYPE_CHECKING:  # the wire's request, read by ToolSpec.of; the engine never imports it
    from libs.protocol import GenerateRequest
from libs.engine.config import StructuredSettings

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# The JSON layout a grammar allows (llguidance's "x-guidance" options): compact separators, no
# free whitespace (a small model given free whitespace can spend its whole budget on newlines).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def with_layout(schema: dict[str, Any], rules: StructuredSettings) -> dict[str, Any]:
    """``schema`` as the grammar engine is given it: read by ``rules``
    (:func:`libs.engine.json_schema.for_grammar`: closed objects, bounded numbers, ASCII classes),
    with :data:`JSON_LAYOUT` (the schema's own ``x-guidance`` keys win)."""
    out = for_grammar(schema, rules)
    return {**out, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A request's tools and how they may be used (from ``GenerateRequest``)."""

    tools: tuple[ToolFunction, ...]
    choice: ToolChoice = "auto"
    name: str | None = None  # a forced function
    parallel: bool = True

    @classmethod
    def of(cls, req: GenerateRequest) -> ToolSpec | None:
        if not req.tools:
            return None
        return cls(tuple(req.tools), req.tool_choice, req.tool_name, req.parallel_tool_calls)

    @property
    def forced(self) -> bool:
        """Every choice must answer with calls (and nothing else)."""
        return self.name is not None or self.choice == "required"

    @property
    def parsed(self) -> bool:
        """The worker reports calls found in the output."""
        return self.choice != "none" or self.name is not None

    def callable(self) -> list[ToolFunction]:
        if self.name is not None:
            return [t for t in self.tools if t.name == self.name]
        return list(self.tools)


def call_schema(tools: list[ToolFunction]) -> dict[str, Any]:
    """JSON schema of one call object: ``{"name": <one of tools>, "arguments": <its schema>}``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_calls_lark(
    spec: ToolSpec, rules: StructuredSettings, or_json: dict[str, Any] | None = None
) -> str:
    """A Lark grammar (llguidance's dialect, ``%json`` for embedded schemas) whose sentences are
    one call, or one or more with parallel calls allowed (never with a named function); with
    ``or_json`` (a JSON schema), a JSON answer under it is a sentence too. Schemas are read by
    ``rules`` (:func:`with_layout`)."""
    schema = json.dumps(with_layout(call_schema(spec.callable()), rules), separators=(",", ":"))
    repeat = "+" if spec.parallel and spec.name is None else ""
    open_, close = json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE)
    start = f"call{repeat}"
    if or_json is not None:
        start = f"%json {json.dumps(with_layout(or_json, rules))} | {start}"
    return f"start: {start}\ncall: {open_} %json {schema} {close}\n"


def fallback_instructions(tools: list[ToolFunction]) -> str:
    """A system-message text that teaches the call format, for chat templates without one."""
    listed = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            separators=(",", ":"),
        )
        for t in tools
    )
    return (
        "You can call these functions:\n"
        f"{listed}\n"
        f"To call one, write {CALL_OPEN}"
        '{"name": <function name>, "arguments": <arguments object>}'
        f"{CALL_CLOSE}; the results come back in the next message."
    )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, tools: list[ToolFunction]) -> tuple[str, list[ToolCall]]:
    """Split a finished choice's text into its own words and the calls after them.

    Returns (text before the first call, stripped; calls). A block that is not a JSON object
    naming one of ``tools`` with an object of arguments is not a call: then no call is reported
    and the whole text stays content (a model that botched the format said something, not
    nothing)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    pos = start
    while pos < len(text):
        if text.startswith(CALL_OPEN, pos):
            end = text.find(CALL_CLOSE, pos)
            if end < 0:
                return text, []
            try:
                body = json.loads(text[pos + len(CALL_OPEN) : end])
            except ValueError:
                return text, []
            if (
                not isinstance(body, dict)
                or body.get("name") not in names
                or not isinstance(body.get("arguments", {}), dict)
            ):
                return text, []
            arguments = json.dumps(body.get("arguments", {}), ensure_ascii=False)
            calls.append(ToolCall(id=new_call_id(), name=body["name"], arguments=arguments))
            pos = end + len(CALL_CLOSE)
        elif text[pos].isspace():
            pos += 1
        else:
            return text, []  # words after a call: not a well-formed answer of calls
    return text[:start].strip(), calls


def content_before_calls(text: str) -> str | None:
    """A tool-calling choice's own words (before its first call); None when it has none."""
    at = text.find(CALL_OPEN)
    return (text[:at] if at >= 0 else text).strip() or None


class CallMarkupFilter:
    """Streamed text as content, minus anything from the first ``<tool_call>`` on.

    The gateway feeds each delta's text and sends what :meth:`feed` returns; a tail that may be
    the start of the markup is held back until the next delta tells. At the end, :meth:`flush`
    returns the held tail when no call came (or the calls did not parse, ``calls_made=False``)."""

    def __init__(self) -> None:
        self.held = ""
        self.in_call = False
        self.after = ""  # text from the markup on (returned by flush when it was no call)

    def feed(self, text: str) -> str:
        if self.in_call:
            self.after += text
            return ""
        text = self.held + text
        self.held = ""
        at = text.find(CALL_OPEN)
        if at >= 0:
            self.in_call = True
            self.after = text[at:]
            return text[:at]
        # Hold the longest tail that is a proper prefix of the markup.
        for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if CALL_OPEN.startswith(text[-k:]):
                self.held = text[-k:]
                return text[:-k]
        return text

    def flush(self, calls_made: bool) -> str:
        """What is left to send as content once the choice ended."""
        tail = self.held + ("" if calls_made else self.after)
        self.held = self.after = ""
        return tail


class ToolCallCollector:
    """Each choice's text as it streams; the calls in it when the choice stops.

    Used by the worker's ``serve`` for requests whose calls are reported (``ToolSpec.parsed``):
    ``add`` is given every chunk and returns the calls on a choice's last chunk (None before,
    and when the choice was cut by its length or made no well-formed call)."""

    def __init__(self, spec: ToolSpec, n: int) -> None:
        self.tools = spec.callable()
        self.texts = [""] * n

    def add(self, chunk: Any) -> list[ToolCall] | None:
        """``chunk``: a ``libs.backend.GenerationChunk``."""
        if not 0 <= chunk.index < len(self.texts):
            return None
        self.texts[chunk.index] += chunk.text
        if chunk.finish_reason != "stop":
            return None
        _, calls = parse_tool_calls(self.texts[chunk.index], self.tools)
        return calls or None


def constraint_kind(req: GenerateRequest) -> str:
    """What constrains a request's output, for spans and logs: json, regex, choice, grammar,
    tools (forced calls), or none."""
    spec = ToolSpec.of(req)
    structured = req.sampling.structured
    kind = structured.kind if structured is not None else ""
    if spec is not None and spec.forced:
        return f"{kind}+tools" if kind else "tools"
    return kind or "none"
