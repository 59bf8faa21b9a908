"""The OpenAI-compatible HTTP front door (FastAPI).

``create_app(settings)`` is called by ``services.gateway.main`` (uvicorn) and by tests. Routes:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models`` (and
``/v1/models/{id}``), ``/v1/files`` and ``/v1/batches`` (``batches.py``; their lines are run by
the ``BatchRunner`` this process starts), ``/health``, ``/ready``, ``/metrics``. A completion passes, in order: API key (``deps.require_key``) → per-key rate
limits (``limits.py``) → response cache (``cache.py``) → backpressure (in-flight bound, pool
queue depth) → one ``GenerateRequest`` on NATS (``completions.py``). The lifespan connects to
NATS, migrates the database and runs the ledger writer (``libs.db.ledger``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from libs.db import Database
from libs.db.batches import BatchStore
from libs.db.ledger import LedgerWriter
from libs.db.responses import ResponseStore
from libs.protocol import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    StreamMessage,
    UsageEvent,
)
from libs.ratelimit import reserve_estimate
from libs.runtime import settle_heap
from libs.settings import Settings, model_identity
from services.gateway import metrics
from services.gateway.auth import KeyInfo, KeyStore, OpenKeyStore
from services.gateway.background import (
    ACTIVE,
    ENDED_WITH_OUTPUT,
    BackgroundRuns,
    pending_history,
    run_background,
)
from services.gateway.batch_runner import BatchRunner
from services.gateway.batches import install_batch_routes
from services.gateway.body_limit import BodyLimit
from services.gateway.cache import ResponseCache, cache_key, is_deterministic
from services.gateway.completions import (
    ChunkShaper,
    CompletionRun,
    Kind,
    SseResponse,
    new_request_id,
    replay_sse,
)
from services.gateway.deps import FleetDep, KeyDep, require_key
from services.gateway.errors import ApiError, install_handlers
from services.gateway.fields import OpenAIFields, checked
from services.gateway.fleet import Fleet
from services.gateway.keystore import DatabaseKeyStore
from services.gateway.limits import RateLimiter
from services.gateway.responses import (
    ResponseCreate,
    ResponseShape,
    input_items,
    new_response_id,
    response_events,
    whole_response,
)
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.translate import (
    DEFAULT_CHAT_MAX_TOKENS,
    chat_request,
    fields_of,
    text_request,
)


def create_app(
    settings: Settings, keys: KeyStore | None = None, fleet: Fleet | None = None
) -> FastAPI:
    g = settings.gateway
    if keys is None:
        keys = DatabaseKeyStore(settings) if g.auth_enabled else OpenKeyStore()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        fleet: Fleet = app.state.fleet
        await fleet.start()
        db: Database | None = None
        ledger: LedgerWriter | None = None
        try:
            if isinstance(keys, DatabaseKeyStore):
                await keys.start()
            if g.ledger_enabled or g.store_responses:
                db = keys.db if isinstance(keys, DatabaseKeyStore) else Database(settings)
                await db.migrate()
            if g.ledger_enabled:
                assert fleet.js is not None and db is not None
                ledger = LedgerWriter(settings, fleet.js, db)
                await ledger.start()
            app.state.ledger = ledger
            app.state.responses = ResponseStore(db) if g.store_responses and db else None
            if app.state.responses is not None:
                app.state.background.start_keeper(app.state.responses)
            app.state.batches = BatchStore(db) if db else None
            if db is not None and settings.batch.runner_enabled:
                runner = BatchRunner(settings, fleet, app.state.batches)
                await runner.start()
                app.state.batch_runner = runner
            settle_heap(settings)
            yield
        finally:
            # Before the database closes: each stops as a stored "failed" response.
            await app.state.background.stop(g.background_stop_s)
            if app.state.batch_runner is not None:
                await app.state.batch_runner.stop()
            if ledger is not None:
                await ledger.stop()
            await fleet.stop()
            if isinstance(keys, DatabaseKeyStore):
                await keys.close()
            elif db is not None:
                await db.close()

    app = FastAPI(title="Strait", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.fleet = fleet or Fleet(settings)
    app.state.keys = keys
    app.state.inflight = 0
    app.state.ledger = None
    app.state.responses = None
    app.state.batches = None
    app.state.batch_runner = None
    app.state.background = background = BackgroundRuns(g.background_lease_s)
    app.state.limiter = limiter = RateLimiter(g.default_rpm, g.default_tpm)
    app.state.cache = cache = ResponseCache(g)
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=g.max_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(fleet: FleetDep) -> JSONResponse:
        workers = fleet.live_workers()
        ok = fleet.connected and workers > 0
        body = {
            "status": "ready" if ok else "not ready",
            "nats": fleet.connected,
            "live_workers": workers,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom(request: Request) -> Response:
        if not g.open_metrics:
            await require_key(request)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict[str, Any]]:
        """Every pool name and pool model, plus ``auto``, as OpenAI's model objects."""
        fleet: Fleet = app.state.fleet
        fleet.registry.expire()
        live = fleet.registry.pools()
        data = []
        now = int(time.time())
        for p in settings.pools:
            engine = settings.engine_for(p)
            for model_id in (p.name, p.model):
                data.append(
                    {
                        "id": model_id,
                        "object": "model",
                        "created": now,
                        "owned_by": "strait",
                        "root": p.model,
                        "strait_pool": p.name,
                        # What the pool's workers hash KV under: name + weights' format.
                        "strait_model_id": model_identity(p.model, engine),
                        "strait_quantization": engine.quantization,
                        "strait_live": p.name in live,
                    }
                )
        data.append(
            {"id": "auto", "object": "model", "created": now, "owned_by": "strait", "root": "auto"}
        )
        return data

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if not g.open_models:
            await require_key(request)
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        if not g.open_models:
            await require_key(request)
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise ApiError(
            404,
            f"The model '{model_id}' does not exist or you do not have access to it.",
            "model_not_found",
            "model",
        )

    def admit_capacity(model: str) -> None:
        fleet: Fleet = app.state.fleet
        if app.state.inflight >= g.max_inflight:
            metrics.REJECTED.labels(code="gateway_full").inc()
            raise ApiError(
                503,
                "gateway is at its in-flight limit (gateway.max_inflight)",
                "no_capacity",
                retry_after_s=g.shed_retry_after_s,
            )
        depth = fleet.queue_depth(model)
        if depth is not None and depth >= g.shed_queue_depth:
            metrics.REJECTED.labels(code="queue_full").inc()
            raise ApiError(
                429,
                f"{depth} requests are queued for model {model!r} "
                "(gateway.shed_queue_depth); retry later",
                "queue_full",
                retry_after_s=g.shed_retry_after_s,
            )

    async def serve_hit(
        kind: Kind,
        hit: dict[str, Any],
        stream: bool,
        include_usage: bool,
        key: KeyInfo,
        req: GenerateRequest,
        reserved: int,
    ) -> Response:
        hit = {**hit, "id": req.request_id, "created": int(time.time())}
        u = hit["usage"]
        limiter.settle(key, reserved, u["total_tokens"])
        await app.state.fleet.usage(
            UsageEvent(
                request_id=req.request_id,
                api_key_id=key.key_id,
                team=key.team,
                model=req.model,
                route_code="cache_hit",
                prompt_tokens=u["prompt_tokens"],
                completion_tokens=u["completion_tokens"],
                cached_tokens=u["prompt_tokens"],
                created_at=req.created_at,
            )
        )
        metrics.REQUESTS.labels(kind=kind, status="cache_hit").inc()
        headers = {"X-Strait-Cache": "hit", "X-Request-Id": req.request_id}
        if stream:
            shaper = ChunkShaper(kind, hit["id"], hit["created"], hit["model"], include_usage)

            async def nothing() -> None:
                return None

            return SseResponse(replay_sse(shaper, hit), nothing, headers)
        return JSONResponse(hit, headers=headers)

    async def begin(
        kind: Kind,
        req: GenerateRequest,
        key: KeyInfo,
        reserved: int,
        include_usage: bool = False,
        fields: OpenAIFields | None = None,
        after_close: Callable[[CompletionRun], None] | None = None,
    ) -> tuple[CompletionRun, StreamMessage]:
        """Past the rate limits (``reserved`` tokens): backpressure, then submit the request
        and wait for its first message. The run's close settles the reservation."""
        try:
            admit_capacity(req.model)
        except ApiError:
            limiter.settle(key, reserved, 0)
            limiter.refund_request(key)
            raise

        def on_close(run: CompletionRun) -> None:
            app.state.inflight -= 1
            metrics.INFLIGHT.set(app.state.inflight)
            f = run.outcome.finished
            used = (
                f.usage.total_tokens if f else (reserved if run.outcome.ttft_s is not None else 0)
            )
            limiter.settle(key, reserved, used)
            if after_close is not None:
                after_close(run)

        app.state.inflight += 1
        metrics.INFLIGHT.set(app.state.inflight)
        run = CompletionRun(app.state.fleet, kind, req, key.key_id, include_usage, on_close, fields)
        try:
            first = await run.start()
        except BaseException:
            await asyncio.shield(run.close())
            raise
        return run, first

    async def submit(
        kind: Kind,
        body: ChatCompletionRequest | CompletionRequest,
        key: KeyInfo,
        req: GenerateRequest,
    ) -> Response:
        reserved = limiter.admit(key, reserve_estimate(req))
        ck = cache_key(key.key_id, kind, body) if cache.enabled and is_deterministic(body) else None
        hit = cache.get(ck) if ck else None
        if hit is not None:
            return await serve_hit(kind, hit, body.stream, body.include_usage, key, req, reserved)

        def fill_cache(run: CompletionRun) -> None:
            out = run.response_body() if ck else None
            if ck and out is not None:
                cache.put(ck, out)

        fields = fields_of(body)
        run, first = await begin(kind, req, key, reserved, body.include_usage, fields, fill_cache)
        headers = {"X-Strait-Cache": "miss" if ck else "bypass"}
        if body.stream:
            return run.streaming_response(first, headers)
        out = await run.collect(first)
        return JSONResponse(out, headers={"X-Request-Id": req.request_id, **headers})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, key: KeyDep) -> Response:
        req = chat_request(body, key, new_request_id("chat"), body.priority)
        return await submit("chat", body, key, req)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, key: KeyDep) -> Response:
        req = text_request(body, key, new_request_id("text"), body.priority)
        return await submit("text", body, key, req)

    # ---------------------------------------------------------------- /v1/responses

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

    install_batch_routes(app, settings)
    return app


def response_not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", "not_found", "response_id")
