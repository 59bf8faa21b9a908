"""``/v1/chat/completions`` and ``/v1/completions``: the body becomes one ``GenerateRequest``
(``translate.py``), then the rate limits (``Admission.reserve``), the response cache
(``cache.py``: a deterministic request already answered is answered again, streamed or whole),
and ``Admission.begin`` (backpressure, submit, first message); the answer streams as SSE or
comes whole (``completions.py``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from libs.protocol import GenerateRequest, UsageEvent
from services.gateway import metrics
from services.gateway.admission import Admission
from services.gateway.auth import KeyInfo
from services.gateway.cache import ResponseCache, cache_key, is_deterministic
from services.gateway.chunks import ChunkShaper, Kind, SseResponse, replay_sse
from services.gateway.completions import CompletionRun, new_request_id
from services.gateway.deps import AdmissionDep, CacheDep, KeyDep
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.translate import chat_request, fields_of, text_request

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(
    body: ChatCompletionRequest, key: KeyDep, admission: AdmissionDep, cache: CacheDep
) -> Response:
    req = chat_request(body, key, new_request_id("chat"), body.priority)
    return await submit("chat", body, key, req, admission, cache)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, key: KeyDep, admission: AdmissionDep, cache: CacheDep
) -> Response:
    req = text_request(body, key, new_request_id("text"), body.priority)
    return await submit("text", body, key, req, admission, cache)


async def submit(
    kind: Kind,
    body: ChatCompletionRequest | CompletionRequest,
    key: KeyInfo,
    req: GenerateRequest,
    admission: Admission,
    cache: ResponseCache,
) -> Response:
    """Rate limits, then the cache's answer or the fleet's; a miss of a cacheable request
    fills the cache when its run closes whole."""
    reserved = admission.reserve(key, req)
    ck = cache_key(key.key_id, kind, body) if cache.enabled and is_deterministic(body) else None
    hit = cache.get(ck) if ck else None
    if hit is not None:
        return await serve_hit(
            kind, hit, body.stream, body.include_usage, key, req, reserved, admission
        )

    def fill_cache(run: CompletionRun) -> None:
        out = run.response_body() if ck else None
        if ck and out is not None:
            cache.put(ck, out)

    fields = fields_of(body)
    run, first = await admission.begin(
        kind, req, key, reserved, body.include_usage, fields, fill_cache
    )
    headers = {"X-Strait-Cache": "miss" if ck else "bypass"}
    if body.stream:
        return run.streaming_response(first, headers)
    out = await run.collect(first)
    return JSONResponse(out, headers={"X-Request-Id": req.request_id, **headers})


async def serve_hit(
    kind: Kind,
    hit: dict[str, Any],
    stream: bool,
    include_usage: bool,
    key: KeyInfo,
    req: GenerateRequest,
    reserved: int,
    admission: Admission,
) -> Response:
    """A cached answer under this request's id: the reservation settles at its usage, and the
    ledger gets a ``cache_hit`` usage event."""
    hit = {**hit, "id": req.request_id, "created": int(time.time())}
    u = hit["usage"]
    admission.limiter.settle(key, reserved, u["total_tokens"])
    await admission.fleet.usage(
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
