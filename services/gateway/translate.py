"""OpenAI request bodies → ``GenerateRequest``: the one place a chat or text completion body
becomes the fleet's request (the HTTP routes and the batch runner both call it), checked by the
engine's input check (``services/gateway/fields.py``) before it is published."""

from __future__ import annotations

import msgspec

from libs.flow.tenant import capped
from libs.protocol import GenerateRequest, Priority, SamplingParams
from services.gateway.auth import KeyInfo
from services.gateway.errors import ApiError
from services.gateway.fields import Api, OpenAIFields, checked
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

# Output tokens when the client sets no limit (OpenAI's completions default is 16; chat's is
# "until the context ends", which we bound).
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_TEXT_MAX_TOKENS = 16


def fields_of(body: ChatCompletionRequest | CompletionRequest) -> OpenAIFields:
    """The OpenAI fields of ``body`` (how an engine error's param is named back to it)."""
    api: Api = "chat" if isinstance(body, ChatCompletionRequest) else "text"
    return OpenAIFields(api, response_format=body.response_format is not None)


def sampling_of(
    body: ChatCompletionRequest | CompletionRequest, default_max: int
) -> SamplingParams:
    """The body's sampling parameters; a constraint that cannot be read is a 400 on its field."""
    try:
        return body.sampling(default_max, body.logprobs_n())
    except ValueError as e:
        param = fields_of(body).of("structured")
        raise ApiError(400, str(e), "invalid_request", param) from None


def with_key_terms(req: GenerateRequest, key: KeyInfo) -> GenerateRequest:
    """``req`` under its key's flow-control terms (docs/flow-control.md): weight, waiting
    bound, and its band capped at the best the key may use. A key of a team takes the team's
    terms from the teams file in the router instead."""
    t = key.terms
    return msgspec.structs.replace(
        req,
        tenant_weight=t.weight,
        tenant_max_waiting=t.max_waiting,
        priority=capped(req.priority, t.priority),
    )


def chat_request(
    body: ChatCompletionRequest, key: KeyInfo, request_id: str, priority: Priority
) -> GenerateRequest:
    try:
        messages = body.wire_messages()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_request", "messages") from None
    tools, tool_choice, tool_name = body.wire_tools()
    req = GenerateRequest(
        request_id=request_id,
        model=body.model,
        messages=messages,
        sampling=sampling_of(body, DEFAULT_CHAT_MAX_TOKENS),
        priority=priority,
        api_key_id=key.key_id,
        team=key.team,
        user=body.user,
        want_route=True,
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=body.parallel_tool_calls,
    )
    return checked(with_key_terms(req, key), fields_of(body))


def text_request(
    body: CompletionRequest, key: KeyInfo, request_id: str, priority: Priority
) -> GenerateRequest:
    prompt, ids = None, None
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif isinstance(body.prompt[0], str):
        prompt = str(body.prompt[0])
    else:
        ids = [int(x) for x in body.prompt]
    req = GenerateRequest(
        request_id=request_id,
        model=body.model,
        prompt=prompt,
        prompt_token_ids=ids,
        sampling=sampling_of(body, DEFAULT_TEXT_MAX_TOKENS),
        priority=priority,
        api_key_id=key.key_id,
        team=key.team,
        user=body.user,
        want_route=True,
    )
    return checked(with_key_terms(req, key), fields_of(body))
