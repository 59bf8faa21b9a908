"""A fake OpenAI-compatible streaming server with known timing, for the benchmark tests.

It serves ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` with
OpenAI-shaped SSE chunks and known timing: the first token after ``FIRST_TOKEN_DELAY_S``, then
one token every ``TOKEN_GAP_S``, ``min(max_tokens, TOKENS)`` tokens in all, then a usage chunk
and ``[DONE]``. The model name ``overloaded`` gets a 429.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FIRST_TOKEN_DELAY_S = 0.15
TOKEN_GAP_S = 0.02
TOKENS = 6


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def _stream(body: dict, chat: bool) -> AsyncIterator[bytes]:
        n = min(int(body.get("max_tokens", TOKENS)), TOKENS)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if chat:  # a role-only first chunk, as OpenAI sends: it must not count as a token
            first = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            yield f"data: {json.dumps(first)}\n\n".encode()
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            finish = "length" if i == n - 1 else None
            if chat:
                choice = {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": f" tok{i}", "finish_reason": finish}
            yield f"data: {json.dumps({'choices': [choice]})}\r\n\r\n".encode()
        if include_usage:
            usage = {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def _handle(request: Request, chat: bool):
        body = await request.json()
        if body.get("model") == "overloaded":
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)
        return StreamingResponse(_stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    return app
