"""The naive baseline: transformers ``generate`` behind the same OpenAI API shape.

Run: ``.venv/bin/python -m bench.hf_server --port 8082`` (then ``strait bench serve --target
hf=http://127.0.0.1:8082``). One process, one model, one request at a time (an asyncio lock
around ``model.generate``), tokens streamed as they come (``TextIteratorStreamer``): what a team
gets by wrapping transformers in a web server without a serving engine. Serves
``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, ``stream_options.
include_usage``, ``max_tokens``, ``temperature``/``top_p``/``seed``, ``ignore_eos``) and
``GET /v1/models``. A benchmark baseline only, never part of the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

DEFAULT_MAX_TOKENS = 256


class HfModel:
    def __init__(self, model_name: str, threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from libs.models import prepare_model
        from libs.settings import get_settings

        if threads:
            torch.set_num_threads(threads)
        path = prepare_model(model_name, get_settings())
        self.name = model_name
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.lock = asyncio.Lock()  # one generate at a time: the naive server's defining trait

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            text = self.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(str(body.get("prompt", "")))["input_ids"])

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[tuple[str, int, int]]:
        """(text delta, prompt tokens, completion tokens so far) as generate produces them."""
        from transformers import TextIteratorStreamer

        ids = self.prompt_ids(body)
        max_tokens = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        temperature = float(body.get("temperature", 1.0))
        kwargs: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(body.get("top_p", 1.0)))
            if body.get("seed") is not None:
                torch.manual_seed(int(body["seed"]))
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, timeout=600)
        async with self.lock:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            out: list[Any] = []

            def run() -> None:
                with torch.inference_mode():
                    out.append(
                        self.model.generate(torch.tensor([ids]), streamer=streamer, **kwargs)
                    )
                loop.call_soon_threadsafe(done.set_result, None)

            threading.Thread(target=run, daemon=True).start()
            it = iter(streamer)
            n = 0
            while True:
                piece = await asyncio.to_thread(next, it, None)
                if piece is None:
                    break
                n += 1
                yield piece, len(ids), n
            await done
            total = int(out[0].shape[1]) - len(ids)
            yield "", len(ids), total


def create_app(hf: HfModel) -> Any:
    app = FastAPI(title="transformers generate baseline")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": hf.name, "object": "model"}]}

    async def complete(request: Request, chat: bool) -> Any:
        body = await request.json()
        rid = f"hf-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if not body.get("stream"):
            text, usage = "", (0, 0)
            async for piece, p, n in hf.stream(body):
                text, usage = text + piece, (p, n)
            message = (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return JSONResponse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": hf.name,
                    "choices": [{"index": 0, **message, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": usage[0],
                        "completion_tokens": usage[1],
                        "total_tokens": sum(usage),
                    },
                }
            )

        async def events() -> AsyncIterator[str]:
            def chunk(choices: list[Any], usage: dict[str, int] | None = None) -> str:
                obj = {
                    "id": rid,
                    "object": f"{kind}.chunk" if chat else kind,
                    "created": created,
                    "model": hf.name,
                    "choices": choices,
                }
                if usage is not None:
                    obj["usage"] = usage
                return f"data: {json.dumps(obj)}\n\n"

            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])
            counts = (0, 0)  # (prompt, completion) tokens, final after the last piece
            async for piece, *tokens in hf.stream(body):
                counts = (tokens[0], tokens[1])
                if piece:
                    yield chunk([choice(piece, None)])
            yield chunk([choice("", "length")])
            if (body.get("stream_options") or {}).get("include_usage"):
                p, n = counts
                usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                yield chunk([], usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="bench.hf_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8082)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    app = create_app(HfModel(args.model, args.threads))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
