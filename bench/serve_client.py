"""Client side of the serving benchmark: send one streaming request and time every chunk.

The stream is read as raw bytes and parsed here (``SSEParser``) instead of through an SDK, so
each server-sent event gets the clock reading of the network read that completed it:

- **TTFT** is from just before the request is sent to the first event carrying output text
  (a role-only first chunk does not count);
- **ITL** is the gap between consecutive text-carrying events. A server that packs several
  tokens into one event shows one gap for them; ``mean_itl_s`` (TPOT: time per output token
  after the first, from the token count) is exact either way;
- **E2E** is from the send to ``data: [DONE]`` (or the end of the body).

Output tokens come from the ``usage`` chunk (requested with ``stream_options.include_usage``)
when the server sends one, else from the number of text-carrying events.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from bench.workloads import BenchRequest

Api = Literal["chat", "completions"]
_ERROR_BODY_CHARS = 300


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI-compatible server to benchmark."""

    name: str
    base_url: str
    api_key: str | None = None
    model: str | None = None
    # Strait's per-request speculation ceiling (num_speculative_tokens; 0: off), sent when set:
    # two targets on one fleet compare speculation on and off in the same run.
    spec: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Target:
        """Parse ``name=URL[,key=APIKEY][,model=MODEL][,spec=N]`` (a bare URL gets the name
        "target")."""
        name, sep, rest = spec.partition("=")
        if not sep or "://" in name:
            name, rest = "target", spec
        url, *options = rest.split(",")
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("key", "model", "spec"):
                raise ValueError(
                    f"bad target option {option!r} in {spec!r}: use key=, model= or spec="
                )
            fields[key] = value
        if not name or "://" not in url:
            raise ValueError(f"bad target {spec!r}: expected name=http://host:port[,key=..]")
        depth = fields.get("spec")
        if depth is not None and not depth.isdigit():
            raise ValueError(f"bad target option spec={depth!r} in {spec!r}: a token count")
        return cls(
            name=name,
            base_url=url,
            api_key=fields.get("key"),
            model=fields.get("model"),
            spec=int(depth) if depth is not None else None,
        )

    @property
    def api_root(self) -> str:
        """The URL that ``/chat/completions`` hangs off (``.../v1``)."""
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else f"{root}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str
    data: str


class SSEParser:
    """Incremental server-sent-events parser (the WHATWG event-stream format, data part).

    ``feed`` takes decoded text in arbitrary pieces and returns the events completed by it.
    Lines end in LF, CRLF or CR; comment lines (``:``) and ``id``/``retry`` fields are ignored.
    ``close`` returns an event left unterminated at the end of the body - the standard drops it,
    but a benchmark would rather see a final ``[DONE]`` a server forgot to end with a blank line.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, text: str) -> list[SSEEvent]:
        self._buffer += text
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            end, after = cut
            line = self._buffer[:end]
            self._buffer = self._buffer[after:]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def close(self) -> list[SSEEvent]:
        tail, self._buffer = self._buffer, ""
        events = [e for e in (self._line(tail) if tail else None, self._line("")) if e]
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent(self._event or "message", "\n".join(self._data))
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def _line_end(buffer: str) -> tuple[int, int] | None:
    """Index of the first line break in ``buffer`` and of the character after it."""
    for i, ch in enumerate(buffer):
        if ch == "\n":
            return i, i + 1
        if ch == "\r":
            if i + 1 == len(buffer):
                return None  # could be the first half of CRLF: wait for more text
            return i, i + 2 if buffer[i + 1] == "\n" else i + 1
    return None


@dataclass(frozen=True, slots=True)
class Sampling:
    """Request parameters shared by every request of a run."""

    temperature: float = 0.0
    ignore_eos: bool = False
    # OpenAI's response_format (e.g. a json_schema), sent as-is to every target.
    response_format: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; ``start_s`` is from the run's start."""

    index: int
    kind: str
    start_s: float = 0.0
    scheduled_s: float | None = None  # open loop: when the arrival process wanted it sent
    ok: bool = False
    status: int | None = None
    error: str | None = None  # "http_429", "timeout", "stream_error", "ConnectError", ...
    error_detail: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text_events: int = 0
    output_tokens: int = 0
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def mean_itl_s(self) -> float | None:
        """Time per output token after the first (TPOT); None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, error: str, detail: str | None = None) -> None:
        self.ok, self.error, self.error_detail = False, error, detail


def build_payload(api: Api, model: str, request: BenchRequest, sampling: Sampling) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        payload["messages"] = request.messages()
    else:
        payload["prompt"] = request.prompt()
    if sampling.ignore_eos:
        payload["ignore_eos"] = True  # llama.cpp and vLLM extension: always emit max_tokens
    if sampling.response_format is not None:
        payload["response_format"] = sampling.response_format
    return payload


def _chunk_text(api: Api, chunk: dict) -> tuple[str, str | None]:
    """Output text and finish reason carried by one stream chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    if api == "chat":
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason")


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    api: Api,
    request: BenchRequest,
    sampling: Sampling,
    timeout_s: float,
) -> RequestRecord:
    """Send ``request`` with streaming and time it; never raises for server or network errors."""
    record = RequestRecord(index=request.index, kind=request.kind)
    url = f"{target.api_root}/{'chat/completions' if api == 'chat' else 'completions'}"
    payload = build_payload(api, model, request, sampling)
    if target.spec is not None:
        payload["num_speculative_tokens"] = target.spec
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, url, target.headers(), payload, api, record, sent)
    except TimeoutError:
        record.fail("timeout", f"no complete response within {timeout_s:g}s (--request-timeout)")
    except httpx.TimeoutException as exc:
        record.fail("timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        record.fail(type(exc).__name__, str(exc))
    if record.e2e_s is None:
        record.e2e_s = time.perf_counter() - sent
    return record


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    payload: dict,
    api: Api,
    record: RequestRecord,
    sent: float,
) -> None:
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        record.status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            record.fail(f"http_{response.status_code}", body[:_ERROR_BODY_CHARS])
            return
        parser = SSEParser()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        last_text_at: float | None = None
        done = False
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            events = parser.feed(decoder.decode(raw))
            for event in events:
                if event.data.strip() == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(event.data)
                except json.JSONDecodeError:
                    record.fail("bad_chunk", event.data[:_ERROR_BODY_CHARS])
                    return
                if not isinstance(chunk, dict):
                    record.fail("bad_chunk", event.data[:_ERROR_BODY_CHARS])
                    return
                if chunk.get("error") is not None or event.event == "error":
                    record.fail("stream_error", json.dumps(chunk.get("error", chunk))[:300])
                    return
                text, finish = _chunk_text(api, chunk)
                if text:
                    if last_text_at is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last_text_at)
                    last_text_at = now
                    record.text_events += 1
                if finish:
                    record.finish_reason = finish
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
                    record.tokens_from_usage = True
                    if usage.get("prompt_tokens") is not None:
                        record.prompt_tokens = int(usage["prompt_tokens"])
            if done:
                break
        if not done:
            done = any(e.data.strip() == "[DONE]" for e in parser.close())
        record.e2e_s = time.perf_counter() - sent
        if not record.tokens_from_usage:
            record.output_tokens = record.text_events
        if not done and record.finish_reason is None:
            record.fail("truncated", "the stream ended without [DONE] or a finish_reason")
            return
        record.ok = True


async def resolve_model(client: httpx.AsyncClient, target: Target) -> str:
    """The target's model: the one given, else the first that ``GET /v1/models`` lists."""
    if target.model:
        return target.model
    response = await client.get(f"{target.api_root}/models", headers=target.headers())
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{target.api_root}/models lists no model; pass model= in --target")
    return str(models[0]["id"])
