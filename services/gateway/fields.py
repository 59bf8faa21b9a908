"""The one mapping from the engine's names of a request's fields to the OpenAI fields a client
sent, and the engine's input check run on every request the gateway translates.

The engine names the field at fault in its own terms (``libs/engine/checks.py``: ``prompt``,
``structured.regex``, ``tool_name``...), in the errors it raises here and in the
``ErrorMessage`` a worker streams back. :class:`OpenAIFields` turns that name into the field of
the body this client sent: ``structured.json`` is ``response_format`` for a chat body that set
``response_format``, ``structured_outputs.json`` for one that set vLLM's ``structured_outputs``,
``text.format`` for a Responses body. Built once per request by the routes (``routes/``) and the
batch runner, used by :func:`checked` before the request is published and by ``CompletionRun``
when the fleet answers with an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libs.engine.errors import BackendError
from libs.protocol import GenerateRequest, check_fields
from services.gateway.errors import ApiError

Api = Literal["chat", "text", "responses"]


@dataclass(frozen=True, slots=True)
class OpenAIFields:
    """The OpenAI fields of one request body: ``api`` is the endpoint's body shape;
    ``response_format``: a chat or text body carried its constraint as ``response_format``
    (else as ``structured_outputs``)."""

    api: Api
    response_format: bool = False

    def of(self, param: str | None) -> str | None:
        """The body field the engine's ``param`` names (None stays None)."""
        if param is None:
            return None
        head, _, kind = param.partition(".")
        if head == "structured":
            if self.api == "responses":
                return "text.format"
            if self.response_format:
                return "response_format"
            return f"structured_outputs.{kind}" if kind else "structured_outputs"
        if param == "tool_name":  # a named function is OpenAI's tool_choice object
            return "tool_choice"
        if param == "prompt_token_ids":  # token ids are a completions body's prompt
            return "prompt"
        if param == "messages" and self.api == "responses":
            return "input"
        return param


def checked(req: GenerateRequest, fields: OpenAIFields) -> GenerateRequest:
    """``req`` after the engine's check across its fields (``check_request``); a refusal is a
    400 naming the body's field. Called on every request the gateway builds, before it is
    published."""
    try:
        check_fields(req)
    except BackendError as e:
        raise ApiError(400, str(e), e.code, fields.of(e.param)) from None
    return req
