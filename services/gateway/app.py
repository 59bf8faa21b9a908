"""The OpenAI-compatible HTTP front door (FastAPI).

``create_app(settings)`` is called by ``services.gateway.main`` (uvicorn) and by tests. Routes:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (and ``/v1/models/{id}``),
``/health``, ``/ready``, ``/metrics`` here; ``/v1/responses`` (``response_routes.py``),
``/v1/files`` and ``/v1/batches`` (``batches.py``; their lines are run by the ``BatchRunner``
this process starts). A completion passes, in order: API key (``deps.require_key``) → per-key
rate limits (``limits.py``) → response cache (``cache.py``) → backpressure (in-flight bound,
pool queue depth: ``admit_capacity``) → one ``GenerateRequest`` on NATS (``completions.py``,
through ``begin``, which the Responses routes share). The lifespan connects to NATS, migrates
the database and runs the ledger writer (``libs.db.ledger``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from libs.adapters import AdapterCatalogue
from libs.db import Database
from libs.db.batches import BatchStore
from libs.db.ledger import LedgerWriter
from libs.db.responses import ResponseStore
from libs.protocol import GenerateRequest, StreamMessage, UsageEvent
from libs.ratelimit import reserve_estimate
from libs.runtime import settle_heap
from libs.settings import Settings, model_identity
from services.gateway import metrics
from services.gateway.adapters import adapter_cards
from services.gateway.auth import KeyInfo, KeyStore, OpenKeyStore
from services.gateway.background import BackgroundRuns
from services.gateway.batch_runner import BatchRunner
from services.gateway.batches import install_batch_routes
from services.gateway.body_limit import BodyLimit
from services.gateway.cache import ResponseCache, cache_key, is_deterministic
from services.gateway.chunks import ChunkShaper, Kind, SseResponse, replay_sse
from services.gateway.completions import CompletionRun, new_request_id
from services.gateway.deps import FleetDep, KeyDep, require_key
from services.gateway.errors import ApiError, install_handlers
from services.gateway.fields import OpenAIFields
from services.gateway.fleet import Fleet
from services.gateway.keystore import DatabaseKeyStore
from services.gateway.limits import RateLimiter
from services.gateway.response_routes import install_response_routes
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.translate import chat_request, fields_of, text_request


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
    app.state.background = BackgroundRuns(g.background_lease_s)
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

    adapters = AdapterCatalogue(settings)  # LoRA adapters, listed with their base as parent

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
        data += adapter_cards(settings, adapters, fleet.registry, now)
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

    install_response_routes(app, settings, begin, admit_capacity)
    install_batch_routes(app, settings)
    return app
