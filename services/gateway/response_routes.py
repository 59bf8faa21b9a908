"""The Responses API's routes (``/v1/responses``): create (foreground, streamed or whole, or
``background``), read back, list its input items, delete, cancel.

Installed by ``create_app`` (``app.py``) with its admission: ``begin`` (past the rate limits:
backpressure, submit, the first message) and ``admit_capacity``; a response is a chat
completion underneath (``responses.py``: the request; ``response_output.py``: the answer).
With ``store`` the response and its conversation are kept per API key (``libs.db.responses``);
``background`` ones run as tasks of this replica (``background.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from libs.db.responses import ResponseStore
from libs.protocol import ChatMessage, GenerateRequest, SamplingParams, StreamMessage
from libs.ratelimit import reserve_estimate
from libs.settings import Settings
from services.gateway.auth import KeyInfo
from services.gateway.background import (
    ACTIVE,
    ENDED_WITH_OUTPUT,
    BackgroundRuns,
    pending_history,
    run_background,
)
from services.gateway.chunks import Kind, SseResponse
from services.gateway.completions import CompletionRun
from services.gateway.deps import KeyDep
from services.gateway.errors import ApiError
from services.gateway.fields import OpenAIFields, checked
from services.gateway.limits import RateLimiter
from services.gateway.response_output import (
    ResponseShape,
    input_items,
    response_events,
    whole_response,
)
from services.gateway.responses import ResponseCreate, new_response_id
from services.gateway.translate import DEFAULT_CHAT_MAX_TOKENS, with_key_terms


class Begin(Protocol):
    """``create_app``'s admission of one request past the rate limits (``reserved`` tokens):
    backpressure, submit, wait for its first message."""

    def __call__(
        self,
        kind: Kind,
        req: GenerateRequest,
        key: KeyInfo,
        reserved: int,
        include_usage: bool = False,
        fields: OpenAIFields | None = None,
        after_close: Callable[[CompletionRun], None] | None = None,
    ) -> Awaitable[tuple[CompletionRun, StreamMessage]]: ...


def install_response_routes(
    app: FastAPI, settings: Settings, begin: Begin, admit_capacity: Callable[[str], None]
) -> None:
    g = settings.gateway
    limiter: RateLimiter = app.state.limiter
    background: BackgroundRuns = app.state.background

    def response_store() -> ResponseStore:
        store: ResponseStore | None = app.state.responses
        if store is None:
            raise ApiError(
                400,
                "responses are not stored here (gateway.store_responses)",
                "invalid_request",
                "store",
            )
        return store

    @app.post("/v1/responses")
    async def create_response(body: ResponseCreate, key: KeyDep) -> Response:
        store = body.store if body.store is not None else app.state.responses is not None
        if store or body.background:
            response_store()  # a 400 when responses are not stored here, before any admission
        history = []
        if body.previous_response_id:
            prev = await response_store().get(body.previous_response_id, key.key_id)
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
        instructions = [ChatMessage("system", body.instructions)] if body.instructions else []
        tools, tool_choice, tool_name = body.wire_tools()
        response_id = new_response_id()
        req = GenerateRequest(
            request_id=response_id,
            model=body.model,
            messages=[*instructions, *conversation],
            sampling=SamplingParams(
                max_tokens=body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                structured=body.structured(),
            ),
            priority=body.priority,
            api_key_id=key.key_id,
            team=key.team,
            user=body.user,
            want_route=True,
            tools=tools,
            tool_choice=tool_choice,
            tool_name=tool_name,
            parallel_tool_calls=body.parallel_tool_calls is not False,
        )
        req = with_key_terms(req, key)
        fields = OpenAIFields("responses")
        checked(req, fields)
        shape = ResponseShape(body, response_id, body.model, store)
        reserved = limiter.admit(key, reserve_estimate(req))
        if body.background:
            return await start_background(shape, conversation, req, key, reserved, fields)
        run, first = await begin("chat", req, key, reserved, False, fields)
        shape.body["model"] = run.shaper.model
        headers = {"X-Request-Id": response_id}

        async def keep() -> None:
            if store and shape.body["status"] in ("completed", "incomplete"):
                turn = [msgspec.to_builtins(m) for m in [*conversation, *shape.history_messages()]]
                await response_store().put(response_id, key.key_id, shape.body, turn)

        if body.stream:
            filtered = bool(tools) and (tool_choice != "none" or tool_name is not None)

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

    async def start_background(
        shape: ResponseShape,
        conversation: list[ChatMessage],
        req: GenerateRequest,
        key: KeyInfo,
        reserved: int,
        fields: OpenAIFields,
    ) -> Response:
        """Store the response ``queued`` and answer with it; ``background.run_background``
        runs it. A full gateway or pool is still a 503 / 429 here, before anything is stored."""
        store = response_store()
        shape.body["status"] = "queued"
        response_id = shape.body["id"]
        try:
            admit_capacity(req.model)
            await store.put(
                response_id,
                key.key_id,
                shape.body,
                pending_history(conversation),
                background.owner,
                background.lease_until(),
            )
        except BaseException:
            limiter.settle(key, reserved, 0)
            limiter.refund_request(key)
            raise
        answer = JSONResponse(shape.body, headers={"X-Request-Id": response_id})
        background.start(
            response_id,
            run_background(
                store,
                key.key_id,
                shape,
                conversation,
                lambda: begin("chat", req, key, reserved, False, fields),
            ),
        )
        return answer

    @app.get("/v1/responses/{response_id}")
    async def get_response(
        response_id: str,
        key: KeyDep,
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
        row = await response_store().get(response_id, key.key_id)
        if row is None:
            raise response_not_found(response_id)
        return row.body

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, key: KeyDep) -> dict[str, Any]:
        row = await response_store().get(response_id, key.key_id)
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

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, key: KeyDep) -> dict[str, Any]:
        if not await response_store().delete(response_id, key.key_id):
            raise response_not_found(response_id)
        background.cancel(response_id)  # nobody will read it: stop generating it
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, key: KeyDep) -> dict[str, Any]:
        store = response_store()
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
            await app.state.fleet.cancel(response_id, "cancelled")
        return cancelled


def response_not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", "not_found", "response_id")
