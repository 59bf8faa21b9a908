"""Hostile-input benchmark: bad requests must cost their sender, not the other users.

Run against a running fleet (``strait up``), never in CI::

    .venv/bin/python -m bench.hostile --url http://127.0.0.1:8000 [--key KEY] [--seed 0]

``--key`` defaults to the development key in ``.strait/dev-api-key`` when that file exists;
``--normal-key`` gives the normal user a key of its own (default: the same key, so they share
its rate limits). ``--help`` lists the other options.

While ONE normal user streams chat completions (``stream=true``, ``max_tokens`` 64) in a loop,
``--requests`` hostile requests go out ``--concurrency`` at a time, built up front from
``--seed`` (the same seed gives the same requests): malformed JSON, wrong types, unknown fields,
huge bodies (up to ``--max-huge-mb`` MB, with a ``Content-Length`` or chunked), empty messages,
out-of-range values, and valid requests mutated by byte flips, truncation or deleted fields.
Prints the hostile requests by kind and status class (2xx / 4xx / 5xx / connection errors), the
4xx answers without an OpenAI error body, and the normal user's streams: how many failed, the
largest gap between two tokens of one stream and whether it stayed under ``--max-gap-s``.

Exit status 1 when a hostile request got a 5xx, a normal stream failed, or the largest gap
reached ``--max-gap-s``; else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from libs.db.keys import DEV_KEY_FILE
from libs.settings import STATE_DIR

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
NORMAL_MAX_TOKENS = 64  # output tokens of each normal stream
HOSTILE_MAX_TOKENS = 8  # output tokens of the valid requests that mutations start from
UPLOAD_CHUNK_BYTES = 64 * 1024  # bytes per chunk of a chunked (no Content-Length) upload
MIB = 1024 * 1024
# Sizes of the huge bodies, as fractions of --max-huge-mb: under, at and over the gateway's
# default 4 MiB limit (with 16 MB: 1, 4, 8 and 16 MB).
HUGE_FRACTIONS = (1 / 16, 1 / 4, 1 / 2, 1.0)
EXAMPLES_SHOWN = 5  # offending answers printed per problem
BODY_SNIPPET_CHARS = 160

Upload = bytes | Callable[[], AsyncIterator[bytes]]


@dataclass(frozen=True, slots=True)
class Hostile:
    """One hostile request: ``body`` is raw bytes (sent with a Content-Length) or a factory of
    a chunked upload."""

    kind: str
    path: str
    body: Upload


@dataclass(slots=True)
class HostileResult:
    kind: str
    status: int | None  # None: connection error or timeout
    error_shaped: bool  # the body is {"error": {"message": str, "type": str, ...}}
    snippet: str


@dataclass(slots=True)
class NormalStats:
    streams: int = 0
    failures: list[str] = field(default_factory=list)
    max_gap_s: float = 0.0  # largest gap between two token events of one stream
    max_ttft_s: float = 0.0


def valid_chat(rng: random.Random, model: str) -> dict[str, Any]:
    words = " ".join(
        rng.choice(("tell", "me", "about", "rivers", "and", "boats")) for _ in range(8)
    )
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": words},
        ],
        "max_tokens": HOSTILE_MAX_TOKENS,
        "temperature": rng.choice((0.0, 0.7)),
        "stream": rng.random() < 0.5,
    }


def malformed_json(rng: random.Random, model: str) -> Hostile:
    text = json.dumps(valid_chat(rng, model))
    raw = rng.choice(
        (
            b"{",
            b"",
            b"null",
            b"[]",
            b'"messages"',
            b"{'model': 'auto'}",
            text.replace('"', "", 1).encode(),
            text.encode() + b"}}",
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
            b'{"model": "' + model.encode() + b'", "messages": [' + b"[" * 5000,
        )
    )
    return Hostile("malformed_json", rng.choice((CHAT, TEXT)), raw)


def wrong_type(rng: random.Random, model: str) -> Hostile:
    body = valid_chat(rng, model)
    field_name, value = rng.choice(
        (
            ("model", 42),
            ("messages", "hello"),
            ("messages", {"role": "user"}),
            ("max_tokens", "eight"),
            ("temperature", [0.5]),
            ("stream", "yes"),
            ("stop", 7),
            ("n", 1.5),
            ("seed", "x"),
            ("stream_options", True),
        )
    )
    body[field_name] = value
    if rng.random() < 0.3:
        body["messages"] = [{"role": 1, "content": {"text": 2}}]
    return Hostile("wrong_type", CHAT, json.dumps(body).encode())


def unknown_fields(rng: random.Random, model: str) -> Hostile:
    body = valid_chat(rng, model)
    for i in range(rng.randrange(1, 20)):
        body[f"x_{i}_{rng.randrange(10**6)}"] = rng.choice((None, 1, "a", [1, {"b": []}], {"c": 1}))
    body["messages"][-1]["weird"] = {"nested": [1, 2, 3]}
    return Hostile("unknown_fields", CHAT, json.dumps(body).encode())


EMPTY_MESSAGES: tuple[list[dict[str, Any]], ...] = (
    [],
    [{}],
    [{"role": "user"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": []}],
    [{"content": "hi"}],
)


def empty_messages(rng: random.Random, model: str) -> Hostile:
    messages = rng.choice(EMPTY_MESSAGES)
    body = {"model": model, "messages": messages, "max_tokens": HOSTILE_MAX_TOKENS}
    return Hostile("empty_messages", CHAT, json.dumps(body).encode())


def out_of_range(rng: random.Random, model: str) -> Hostile:
    body = valid_chat(rng, model)
    field_name, value = rng.choice(
        (
            ("max_tokens", 0),
            ("max_tokens", -5),
            ("max_tokens", 10**12),
            ("temperature", -1.0),
            ("temperature", 1e308),
            ("top_p", 0.0),
            ("top_p", 2.0),
            ("n", 0),
            ("n", 10_000),
            ("seed", 2**70),
            ("top_logprobs", 50),
            ("presence_penalty", 99.0),
            ("user", "u" * 10_000),
            ("stop", ["s"] * 1000),
            ("stop_token_ids", list(range(10_000))),
        )
    )
    body[field_name] = value
    if rng.random() < 0.2:  # completions with token ids far outside any vocabulary
        text = {"model": model, "prompt": [-5, 2**31, 10**9], "max_tokens": HOSTILE_MAX_TOKENS}
        return Hostile("out_of_range", TEXT, json.dumps(text).encode())
    return Hostile("out_of_range", CHAT, json.dumps(body).encode())


def byte_flip(rng: random.Random, model: str) -> Hostile:
    raw = bytearray(json.dumps(valid_chat(rng, model)).encode())
    for _ in range(rng.randrange(1, 6)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return Hostile("byte_flip", CHAT, bytes(raw))


def truncation(rng: random.Random, model: str) -> Hostile:
    raw = json.dumps(valid_chat(rng, model)).encode()
    return Hostile("truncation", CHAT, raw[: rng.randrange(len(raw))])


def field_deletion(rng: random.Random, model: str) -> Hostile:
    body = valid_chat(rng, model)
    for _ in range(rng.randrange(1, 3)):
        messages = body.get("messages") or [{}]
        target = body if rng.random() < 0.6 else rng.choice(messages)
        if target:
            del target[rng.choice(sorted(target))]
    return Hostile("field_deletion", CHAT, json.dumps(body).encode())


def huge_maker(max_huge_mb: float) -> Callable[[random.Random, str], Hostile]:
    """Builds huge bodies; each size's bytes are made once and shared between requests."""
    made: dict[int, bytes] = {}

    def huge(rng: random.Random, model: str) -> Hostile:
        size = int(rng.choice(HUGE_FRACTIONS) * max_huge_mb * MIB)  # bytes
        if size not in made:
            head = (
                b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "'
            )
            made[size] = head + b"a" * max(0, size - len(head) - 4) + b'"}]}'
        raw = made[size]
        if rng.random() < 0.5:
            return Hostile("huge_body", CHAT, raw)

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), UPLOAD_CHUNK_BYTES):
                yield raw[i : i + UPLOAD_CHUNK_BYTES]

        return Hostile("huge_body_chunked", CHAT, chunks)

    return huge


def build_hostile(n: int, seed: int, model: str, max_huge_mb: float) -> list[Hostile]:
    """``n`` hostile requests, the same for the same arguments (kinds drawn evenly)."""
    rng = random.Random(seed)
    makers = [
        malformed_json,
        wrong_type,
        unknown_fields,
        empty_messages,
        out_of_range,
        byte_flip,
        truncation,
        field_deletion,
        huge_maker(max_huge_mb),
    ]
    return [rng.choice(makers)(rng, model) for _ in range(n)]


def error_shaped(raw: bytes) -> bool:
    """True when ``raw`` is OpenAI's error body: {"error": {"message": str, "type": str, ...}}."""
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and "code" in err
    )


async def send_hostile(client: httpx.AsyncClient, h: Hostile) -> HostileResult:
    content = h.body if isinstance(h.body, bytes) else h.body()
    try:
        async with client.stream(
            "POST", h.path, content=content, headers={"Content-Type": "application/json"}
        ) as r:
            raw = await r.aread()
    except httpx.TransportError as e:  # connection refused/reset, timeouts
        return HostileResult(h.kind, None, False, f"{type(e).__name__}: {e}")
    snippet = raw[:BODY_SNIPPET_CHARS].decode("utf-8", "replace")
    return HostileResult(h.kind, r.status_code, error_shaped(raw), snippet)


async def run_hostile(
    client: httpx.AsyncClient, requests: list[Hostile], concurrency: int
) -> list[HostileResult]:
    gate = asyncio.Semaphore(concurrency)

    async def one(h: Hostile) -> HostileResult:
        async with gate:
            return await send_hostile(client, h)

    return await asyncio.gather(*(one(h) for h in requests))


async def normal_stream(client: httpx.AsyncClient, model: str, stats: NormalStats) -> None:
    """One streaming chat of the normal user; records its token gaps, TTFT and any failure."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a short story about a river."}],
        "max_tokens": NORMAL_MAX_TOKENS,
        "stream": True,
    }
    start = time.monotonic()
    last: float | None = None  # clock reading of the previous token event
    done = False
    try:
        async with client.stream("POST", CHAT, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                stats.failures.append(f"HTTP {r.status_code}: {raw[:BODY_SNIPPET_CHARS]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    stats.failures.append(f"stream error: {event['error']}")
                    return
                choices = event.get("choices") or [{}]
                if not (choices[0].get("delta") or {}).get("content"):
                    continue
                now = time.monotonic()
                if last is None:
                    stats.max_ttft_s = max(stats.max_ttft_s, now - start)
                else:
                    stats.max_gap_s = max(stats.max_gap_s, now - last)
                last = now
    except httpx.TransportError as e:
        stats.failures.append(f"{type(e).__name__}: {e}")
        return
    if not done:
        stats.failures.append("stream ended without data: [DONE]")
        return
    stats.streams += 1


async def run_normal(client: httpx.AsyncClient, model: str, stop: asyncio.Event) -> NormalStats:
    """The normal user: streams one chat after another until ``stop`` (at least one)."""
    stats = NormalStats()
    while True:
        await normal_stream(client, model, stats)
        if stop.is_set():
            return stats


def report(results: list[HostileResult], normal: NormalStats, wall_s: float, args: Any) -> bool:
    """Prints the tables; True when the run passed."""
    classes = ("2xx", "4xx", "5xx", "conn")
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for res in results:
        cls = "conn" if res.status is None else f"{res.status // 100}xx"
        by_kind[res.kind][cls] += 1
    total: Counter[str] = Counter()
    print(f"hostile requests: {len(results)} (seed {args.seed}) in {wall_s:.1f} s")
    print(f"{'kind':<20}{'n':>6}" + "".join(f"{c:>7}" for c in classes))
    for kind in sorted(by_kind):
        row = by_kind[kind]
        total.update(row)
        print(f"{kind:<20}{sum(row.values()):>6}" + "".join(f"{row[c]:>7}" for c in classes))
    print(f"{'total':<20}{sum(total.values()):>6}" + "".join(f"{total[c]:>7}" for c in classes))

    fivexx = [r for r in results if r.status is not None and r.status >= 500]
    unshaped = [
        r for r in results if r.status is not None and 400 <= r.status < 500 and not r.error_shaped
    ]
    conn = [r for r in results if r.status is None]
    for title, rows in (("5xx", fivexx), ("4xx without an OpenAI error body", unshaped)):
        print(f"{title}: {len(rows)}")
        for r in rows[:EXAMPLES_SHOWN]:
            print(f"  {r.kind} {r.status}: {r.snippet}")
    print(f"connection errors: {len(conn)}")
    for r in conn[:EXAMPLES_SHOWN]:
        print(f"  {r.kind}: {r.snippet}")

    gap_ok = normal.streams > 0 and normal.max_gap_s < args.max_gap_s
    print(
        f"normal user: {normal.streams} streams, {len(normal.failures)} failed, "
        f"max TTFT {normal.max_ttft_s:.3f} s, max inter-token gap {normal.max_gap_s:.3f} s "
        f"(under {args.max_gap_s:g} s: {'yes' if gap_ok else 'NO'})"
    )
    for f in normal.failures[:EXAMPLES_SHOWN]:
        print(f"  {f}")
    passed = not fivexx and not normal.failures and gap_ok
    print("PASS" if passed else "FAIL")
    return passed


def default_key() -> str | None:
    path = STATE_DIR / DEV_KEY_FILE
    return path.read_text().strip() if path.exists() else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.hostile",
        description="Hostile requests vs one normal streaming user (see the module docstring).",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument(
        "--key", default=default_key(), help=f"API key (default: {STATE_DIR / DEV_KEY_FILE})"
    )
    p.add_argument("--normal-key", default=None, help="the normal user's key (default: --key)")
    p.add_argument("--model", default="auto", help="model (or pool) of every request")
    p.add_argument("--requests", type=int, default=300, help="hostile requests in all")
    p.add_argument("--concurrency", type=int, default=32, help="hostile requests at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the hostile requests")
    p.add_argument("--max-huge-mb", type=float, default=16.0, help="largest body, in MiB")
    p.add_argument(
        "--max-gap-s", type=float, default=1.0, help="largest allowed inter-token gap, seconds"
    )
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout, seconds")
    return p.parse_args(argv)


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run(args: argparse.Namespace) -> bool:
    requests = build_hostile(args.requests, args.seed, args.model, args.max_huge_mb)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with (
        httpx.AsyncClient(
            base_url=args.url, headers=auth(args.key), timeout=args.timeout_s, limits=limits
        ) as hostile_client,
        httpx.AsyncClient(
            base_url=args.url, headers=auth(args.normal_key or args.key), timeout=args.timeout_s
        ) as normal_client,
    ):
        stop = asyncio.Event()
        normal = asyncio.create_task(run_normal(normal_client, args.model, stop))
        start = time.monotonic()
        results = await run_hostile(hostile_client, requests, args.concurrency)
        wall_s = time.monotonic() - start
        stop.set()
        stats = await normal
    return report(results, stats, wall_s, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return 0 if asyncio.run(run(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
