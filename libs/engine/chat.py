"""A chat (messages, tools, tool calls and results) as the model's prompt text.

Used by ``AsyncEngineBackend.prepare`` (on a worker thread). With a chat template that renders
tools (Qwen, Hermes, Llama 3.1…), transformers' ``apply_chat_template(tools=...)`` does it all:
tool definitions, assistant ``tool_calls`` and ``tool`` results. With one that ignores them
(SmolLM2's), Strait's fallback keeps the conversation meaningful: the call format is taught in
the system message (``libs.engine.tools.fallback_instructions``), earlier calls are written back
as that markup, and tool results become user turns wrapped in ``<tool_response>``.
"""

from __future__ import annotations

import json
from typing import Any

from libs.engine.params import ChatMessage, ToolCall, ToolFunction
from libs.engine.tools import CALL_CLOSE, CALL_OPEN, ToolSpec, fallback_instructions

_PROBE_TOOL = ToolFunction(name="probe_tool", description="probe")


def _tool_json(t: ToolFunction) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


def _arguments(c: ToolCall) -> Any:
    try:
        return json.loads(c.arguments)
    except ValueError:
        return c.arguments


def _markup(calls: list[ToolCall]) -> str:
    return "".join(
        f"{CALL_OPEN}{json.dumps({'name': c.name, 'arguments': _arguments(c)})}{CALL_CLOSE}"
        for c in calls
    )


class ChatRenderer:
    """One per backend: the tokenizer's template, and whether it knows tools (probed once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._template_has_tools: bool | None = None
        # Characters the longest token spans: a text of c characters has >= c / this tokens.
        self.max_token_chars = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))

    @property
    def template_has_tools(self) -> bool:
        if self._template_has_tools is None:
            probe = [{"role": "user", "content": "x"}]
            try:
                with_tool = self._apply(probe, [_tool_json(_PROBE_TOOL)])
            except Exception:  # a template that raises on tools does not render them
                with_tool = None
            self._template_has_tools = with_tool is not None and with_tool != self._apply(
                probe, None
            )
        return self._template_has_tools

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def render(self, messages: list[ChatMessage], tools: ToolSpec | None) -> str:
        uses_tools = tools is not None or any(m.tool_calls or m.role == "tool" for m in messages)
        if uses_tools and self.template_has_tools:
            return self._apply(
                [self._native(m) for m in messages],
                [_tool_json(t) for t in tools.tools] if tools is not None else None,
            )
        if not uses_tools:
            return self._apply([{"role": m.role, "content": m.content} for m in messages], None)
        out = [self._fallback(m) for m in messages]
        if tools is not None:
            teach = fallback_instructions(list(tools.tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{teach}"}
            else:
                out.insert(0, {"role": "system", "content": teach})
        return self._apply(out, None)

    @staticmethod
    def _native(m: ChatMessage) -> dict[str, Any]:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments(c)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        return d

    @staticmethod
    def _fallback(m: ChatMessage) -> dict[str, Any]:
        if m.role == "tool":
            return {
                "role": "user",
                "content": f"<tool_response>\n{m.content}\n</tool_response>",
            }
        if m.tool_calls:
            return {"role": m.role, "content": m.content + _markup(m.tool_calls)}
        return {"role": m.role, "content": m.content}
