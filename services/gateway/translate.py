"""OpenAI request bodies → ``GenerateRequest``: the one place an HTTP body becomes the fleet's
request. ``generate_request`` builds every one (who sends it, from the API key; how it is
routed); ``chat_request`` and ``text_request`` read chat and text completion bodies (the HTTP
routes and the batch runner call them), the Responses route its own body
(``routes/responses.py``). Each is checked by the engine's input check
(``services/gateway/fields.py``) before it is published."""

from __future__ import annotations

from libs.flow.tenant import capped
from libs.protocol import (
    ChatMessage,
    GenerateRequest,
    Priority,
    SamplingParams,
    ToolChoice,
    ToolFunction,
)
from services.gateway.auth import KeyInfo
from services.gateway.errors import ApiError
from services.gateway.fields import Api, OpenAIFields, checked
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

# Output tokens when the client sets no limit (OpenAI's completions default is 16; chat's is
# "until the context ends", which we bound).
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_TEXT_MAX_TOKENS = 16

# A body's tools as the wire carries them: functions, tool_choice, a forced function's name.
Tools = tuple[list[ToolFunction] | None, ToolChoice, str | None]


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


def generate_request(
    key: KeyInfo,
    request_id: str,
    model: str,
    sampling: SamplingParams,
    priority: Priority,
    user: str | None,
    fields: OpenAIFields,
    *,
    messages: list[ChatMessage] | None = None,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    tools: Tools = (None, "auto", None),
    parallel_tool_calls: bool = True,
) -> GenerateRequest:
    """The fleet's request for one HTTP body, sent as ``key`` (its id and team, and its
    flow-control terms: weight, waiting bound, and the band capped at the best the key may
    use; a key of a team takes the team's from the teams file in the router instead,
    docs/flow-control.md), asking the router to echo its route; a value the engine would
    refuse is a 400 on ``fields``' name for it."""
    tool_list, tool_choice, tool_name = tools
    req = GenerateRequest(
        request_id=request_id,
        model=model,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        sampling=sampling,
        priority=capped(priority, key.terms.priority),
        api_key_id=key.key_id,
        team=key.team,
        tenant_weight=key.terms.weight,
        tenant_max_waiting=key.terms.max_waiting,
        user=user,
        want_route=True,
        tools=tool_list,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel_tool_calls,
    )
    return checked(req, fields)


def chat_request(
    body: ChatCompletionRequest, key: KeyInfo, request_id: str, priority: Priority
) -> GenerateRequest:
    try:
        messages = body.wire_messages()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_request", "messages") from None
    return generate_request(
        key,
        request_id,
        body.model,
        sampling_of(body, DEFAULT_CHAT_MAX_TOKENS),
        priority,
        body.user,
        fields_of(body),
        messages=messages,
        tools=body.wire_tools(),
        parallel_tool_calls=body.parallel_tool_calls,
    )


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
    return generate_request(
        key,
        request_id,
        body.model,
        sampling_of(body, DEFAULT_TEXT_MAX_TOKENS),
        priority,
        body.user,
        fields_of(body),
        prompt=prompt,
        prompt_token_ids=ids,
    )
