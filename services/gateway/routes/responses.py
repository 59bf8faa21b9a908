"""The Responses API (``/v1/responses``): create (foreground, streamed or whole, or
``background``), read back, list its input items, delete, cancel.

A response is a chat completion underneath (``responses.py``: the body; ``response_output.py``:
the answer), admitted like one (``admission.py``). With ``store`` the response and its
conversation are kept per API key (``libs.db.responses``); ``background`` ones run as tasks of
this replica (``background.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from libs.db.responses import ResponseStore
from libs.protocol import ChatMessage, GenerateRequest, SamplingParams
from libs.settings import GatewaySettings
from services.gateway.admission import Admission
from services.gateway.auth import KeyInfo
from services.gateway.background import (
    ACTIVE,
    ENDED_WITH_OUTPUT,
    BackgroundRuns,
    pending_history,
    run_background,
)
from services.gateway.chunks import SseResponse
from services.gateway.deps import (
    AdmissionDep,
    BackgroundDep,
    FleetDep,
    KeyDep,
    ResponsesDep,
    SettingsDep,
)
from services.gateway.errors import ApiError
from services.gateway.fields import OpenAIFields
from services.gateway.response_output import (
    ResponseShape,
    input_items,
    response_events,
    whole_response,
)
from services.gateway.responses import ResponseCreate, new_response_id
from services.gateway.translate import DEFAULT_CHAT_MAX_TOKENS, generate_request

router = APIRouter()
FIELDS = OpenAIFields("responses")


def stored(store: ResponseStore | None) -> ResponseStore:
    """The response store, or a 400 naming why there is none."""
    if store is None:
        raise ApiError(
            400,
            "responses are not stored here (gateway.store_responses)",
            "invalid_request",
            "store",
        )
    return store


def response_not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", "not_found", "response_id")


@router.post("/v1/responses")
async def create_response(
    body: ResponseCreate,
    key: KeyDep,
    settings: SettingsDep,
    admission: AdmissionDep,
    background: BackgroundDep,
    responses: ResponsesDep,
) -> Response:
    store = body.store if body.store is not None else responses is not None
    if store or body.background:
        stored(responses)  # a 400 when responses are not stored here, before any admission
    conversation = await conversation_of(body, key, responses, settings.gateway)
    req = response_request(body, key, conversation, new_response_id())
    shape = ResponseShape(body, req.request_id, body.model, store)
    reserved = admission.reserve(key, req)
    if body.background:
        return await start_background(
            shape, conversation, req, key, reserved, admission, background, stored(responses)
        )
    run, first = await admission.begin("chat", req, key, reserved, False, FIELDS)
    shape.body["model"] = run.shaper.model
    headers = {"X-Request-Id": req.request_id}

    async def keep() -> None:
        if store and shape.body["status"] in ("completed", "incomplete"):
            turn = [msgspec.to_builtins(m) for m in [*conversation, *shape.history_messages()]]
            await stored(responses).put(req.request_id, key.key_id, shape.body, turn)

    if body.stream:
        filtered = bool(req.tools) and (req.tool_choice != "none" or req.tool_name is not None)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for line in response_events(shape, run, first, filtered):
                    yield line
                await keep()
            finally:
                await asyncio.shield(run.close())

        return SseResponse(events(), run.close, headers)
    out = whole_response(shape, await run.collect(first))
    await keep()
    return JSONResponse(out, headers=headers)


async def conversation_of(
    body: ResponseCreate, key: KeyInfo, responses: ResponseStore | None, g: GatewaySettings
) -> list[ChatMessage]:
    """The messages of this response: ``previous_response_id``'s conversation, then the
    body's input; a 400 for a previous response that is
    not found or not ended with output, or a conversation over
    ``gateway.response_history_max_messages``."""
    history = []
    if body.previous_response_id:
        prev = await stored(responses).get(body.previous_response_id, key.key_id)
        if prev is None:
            raise ApiError(
                400,
                f"Previous response with id '{body.previous_response_id}' not found.",
                "previous_response_not_found",
                "previous_response_id",
            )
        if prev.body.get("status") not in ENDED_WITH_OUTPUT:
            raise ApiError(
                400,
                f"Previous response with id '{body.previous_response_id}' is "
                f"{prev.body.get('status')}; only a completed or incomplete one can be "
                "continued.",
                "invalid_request",
                "previous_response_id",
            )
        history = [msgspec.convert(m, ChatMessage) for m in prev.history]
    conversation = [*history, *body.input_messages()]
    if len(conversation) > g.response_history_max_messages:
        raise ApiError(
            400,
            f"the conversation has {len(conversation)} messages, over "
            f"gateway.response_history_max_messages ({g.response_history_max_messages})",
            "invalid_request",
            "previous_response_id" if history else "input",
        )
    if not conversation:
        raise ApiError(400, "input must not be empty", "invalid_request", "input")
    return conversation


def response_request(
    body: ResponseCreate, key: KeyInfo, conversation: list[ChatMessage], response_id: str
) -> GenerateRequest:
    """The chat request a response is: its instructions as the system message, then the
    conversation; OpenAI's Responses defaults for what the body leaves out."""
    instructions = [ChatMessage("system", body.instructions)] if body.instructions else []
    sampling = SamplingParams(
        max_tokens=body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        structured=body.structured(),
    )
    return generate_request(
        key,
        response_id,
        body.model,
        sampling,
        body.priority,
        body.user,
        FIELDS,
        messages=[*instructions, *conversation],
        tools=body.wire_tools(),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


async def start_background(
    shape: ResponseShape,
    conversation: list[ChatMessage],
    req: GenerateRequest,
    key: KeyInfo,
    reserved: int,
    admission: Admission,
    background: BackgroundRuns,
    store: ResponseStore,
) -> Response:
    """Store the response ``queued`` and answer with it; ``background.run_background``
    runs it. A full gateway or pool is still a 503 / 429 here, before anything is stored."""
    shape.body["status"] = "queued"
    response_id = shape.body["id"]
    try:
        admission.check_capacity(req.model)
        await store.put(
            response_id,
            key.key_id,
            shape.body,
            pending_history(conversation),
            background.owner,
            background.lease_until(),
        )
    except BaseException:
        admission.release(key, reserved)
        raise
    answer = JSONResponse(shape.body, headers={"X-Request-Id": response_id})
    background.start(
        response_id,
        run_background(
            store,
            key.key_id,
            shape,
            conversation,
            lambda: admission.begin("chat", req, key, reserved, False, FIELDS),
        ),
    )
    return answer


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str,
    key: KeyDep,
    responses: ResponsesDep,
    stream: bool = False,
    starting_after: int | None = None,
) -> dict[str, Any]:
    if stream or starting_after is not None:
        raise ApiError(
            400,
            "a stored response is read whole here; streaming it again is not supported",
            "unsupported_parameter",
            "stream" if stream else "starting_after",
        )
    row = await stored(responses).get(response_id, key.key_id)
    if row is None:
        raise response_not_found(response_id)
    return row.body


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(
    response_id: str, key: KeyDep, responses: ResponsesDep
) -> dict[str, Any]:
    row = await stored(responses).get(response_id, key.key_id)
    if row is None:
        raise response_not_found(response_id)
    items = input_items(row.history[:-1])
    return {
        "object": "list",
        "data": items[::-1],  # OpenAI's default order: newest first
        "first_id": items[-1]["id"] if items else None,
        "last_id": items[0]["id"] if items else None,
        "has_more": False,
    }


@router.delete("/v1/responses/{response_id}")
async def delete_response(
    response_id: str, key: KeyDep, responses: ResponsesDep, background: BackgroundDep
) -> dict[str, Any]:
    if not await stored(responses).delete(response_id, key.key_id):
        raise response_not_found(response_id)
    background.cancel(response_id)  # nobody will read it: stop generating it
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str,
    key: KeyDep,
    responses: ResponsesDep,
    background: BackgroundDep,
    fleet: FleetDep,
) -> dict[str, Any]:
    store = stored(responses)
    row = await store.get(response_id, key.key_id)
    if row is None:
        raise response_not_found(response_id)
    if not row.body.get("background"):  # OpenAI's answer for a foreground response
        raise ApiError(
            400, "Only background responses can be cancelled.", "invalid_request", "response_id"
        )
    if row.body.get("status") not in ACTIVE:
        return row.body  # ended (or cancelled before): as it is
    cancelled = {**row.body, "status": "cancelled"}
    if not await store.advance(response_id, key.key_id, cancelled, row.history, ACTIVE):
        got = await store.get(response_id, key.key_id)  # it ended meanwhile
        if got is None:
            raise response_not_found(response_id)
        return got.body
    if not background.cancel(response_id):
        # Another replica runs it: free the workers now; that replica's wait for the
        # stream ends at its idle timeout and its writes are no-ops.
        await fleet.cancel(response_id, "cancelled")
    return cancelled
