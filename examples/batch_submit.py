"""Submit many prompts over NATS with bounded concurrency; write one JSON line per result.

    python -m examples.batch_submit --nats nats://127.0.0.1:4222 --input prompts.jsonl \\
        --output results.jsonl --concurrency 64 --max-tokens 64

Input: a ``.jsonl`` file (each line ``{"prompt": ...}`` or ``{"messages": [...]}``, optionally
``"id"`` and any request field such as ``"max_tokens"``), or a text file (one prompt a line), or
nothing (``--n`` generated prompts, default 1000). Output: one line per prompt, in input order,
``{"id", "request_id", "text", "finish_reason", "usage"}`` or ``{"id", "error": {"code", ...}}``.
Retryable errors (no_capacity, no_worker, rate_limited, worker_lost) are retried with backoff.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from libs.client import Retryable, StraitClient, StraitError

REQUEST_FIELDS = {
    "model", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k",
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "seed", "n",
    "logprobs", "priority", "user",
}  # fmt: skip


@dataclass
class BatchStats:
    ok: int = 0
    failed: int = 0
    retries: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return (self.ok + self.failed) / self.seconds if self.seconds else 0.0


def load_prompts(path: str | None, n: int) -> list[dict[str, Any]]:
    """Items ``{"id", "prompt"|"messages", ...}`` from a JSONL or text file, or ``n`` generated."""
    if path is None:
        return [{"id": str(i), "prompt": f"Write a haiku about the number {i}."} for i in range(n)]
    items = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        item = json.loads(line) if path.endswith(".jsonl") else {"prompt": line}
        item.setdefault("id", str(i))
        items.append(item)
    return items


async def run(
    client: StraitClient,
    items: Sequence[dict[str, Any]],
    output: str,
    *,
    concurrency: int = 64,
    max_tokens: int = 64,
    model: str = "auto",
    max_retries: int = 5,
    progress: bool = True,
) -> BatchStats:
    """Run every item through ``client`` (at most ``concurrency`` at once); write ``output``."""
    stats = BatchStats()
    slots = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any] | None] = [None] * len(items)
    bar = tqdm(total=len(items), unit="req", disable=not progress, file=sys.stderr)

    async def one(i: int, item: dict[str, Any]) -> None:
        opts: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "priority": "batch"}
        opts |= {k: v for k, v in item.items() if k in REQUEST_FIELDS}
        async with slots:
            for attempt in range(max_retries + 1):
                try:
                    done = await client.complete(item.get("prompt"), **opts)
                    results[i] = {
                        "id": item["id"], "request_id": done.request_id, "text": done.text,
                        "finish_reason": done.finish_reasons[0],
                        "usage": {"prompt_tokens": done.usage.prompt_tokens,
                                  "completion_tokens": done.usage.completion_tokens,
                                  "cached_tokens": done.usage.cached_tokens},
                    }  # fmt: skip
                    stats.ok += 1
                    stats.completion_tokens += done.usage.completion_tokens
                    break
                except Retryable as e:
                    if attempt == max_retries:
                        results[i] = _error(item, e)
                        stats.failed += 1
                        break
                    stats.retries += 1
                    backoff = e.retry_after_s or 0.2 * 2**attempt
                    await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
                except StraitError as e:
                    results[i] = _error(item, e)
                    stats.failed += 1
                    break
        bar.update()

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - t0
    await asyncio.to_thread(_write_jsonl, output, [r for r in results if r is not None])
    return stats


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _error(item: dict[str, Any], e: StraitError) -> dict[str, Any]:
    return {"id": item["id"], "error": {"code": e.code, "message": e.message, "param": e.param}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS URL")
    p.add_argument("--prefix", default="strait.v1", help="subject prefix of the fleet")
    p.add_argument("--input", help=".jsonl or text file of prompts (default: generated)")
    p.add_argument("--n", type=int, default=1000, help="generated prompts when no --input")
    p.add_argument("--output", default="results.jsonl")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="auto")
    p.add_argument("--api-key-id", help="attributes usage (not a credential)")
    return p


async def _main(args: argparse.Namespace) -> int:
    items = load_prompts(args.input, args.n)
    async with StraitClient(args.nats, prefix=args.prefix, api_key_id=args.api_key_id) as client:
        stats = await run(
            client, items, args.output, concurrency=args.concurrency,
            max_tokens=args.max_tokens, model=args.model,
        )  # fmt: skip
    print(
        f"{stats.ok} ok, {stats.failed} failed, {stats.retries} retries in {stats.seconds:.2f}s: "
        f"{stats.requests_per_s:.1f} req/s, {stats.completion_tokens / max(stats.seconds, 1e-9):.0f} "
        f"tokens/s → {args.output}"
    )
    return 0 if stats.failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
