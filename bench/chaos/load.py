"""The fault campaign's load: ``--streams`` slots, each sending a request and reading its stream
to the end (HTTP or NATS), and the reference answers the streams are checked against.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.fleet import MODEL, Fleet, Opts
from libs.wire.nats_util import server_urls

DISAGG_PROMPTS = [f"Write a haiku about the number {k}." for k in range(6)]


DISAGG_MAX_TOKENS = 100  # prompt + answer within the engine's max_model_len of 256


@dataclass
class Call:
    """One request of the load and what its client saw."""

    k: int
    path: str  # "http" or "nats"
    seed: int
    t_send: float = 0.0
    t_end: float | None = None
    request_id: str = ""
    gateway: int = -1
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    usage: int | None = None
    status: str = "running"  # ok | failed | hang
    error: str = ""
    migrations: int = 0
    fixed_prompt: str = ""  # one of a scenario's fixed prompts ("": the k-th prompt)

    @property
    def prompt(self) -> str:
        return self.fixed_prompt or f"Write a haiku about the number {self.k}."

    def fail(self, why: str) -> None:
        self.status, self.error = "failed", why


async def quiet(e: Exception) -> None:
    return None


class Load:
    """``streams`` slots, each sending its next request as soon as the previous one ended."""

    def __init__(self, fleet: Fleet, opts: Opts) -> None:
        self.fleet, self.opts = fleet, opts
        self.calls: list[Call] = []
        self.stop_new = False
        self.client: Any = None
        self.hosts = [u.removeprefix("http://").rsplit(":", 1) for u in fleet.gateway_urls]
        self.model = fleet.model
        # A scenario's fixed prompts (request k sends prompts[k % n]), sent greedy
        # (temperature 0): their texts are compared with one uninterrupted run of each.
        self.prompts: list[str] = []

    def body(self, c: Call) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": c.prompt}],
            "max_tokens": self.opts.max_tokens,
            "seed": c.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.prompts:
            body["temperature"] = 0.0
        return json.dumps(body).encode()

    async def http_call(self, c: Call, gw: int) -> int:
        """One streamed request; tries the next gateway when one refuses the connection.
        Returns the gateway used (the slot keeps it)."""
        for attempt in range(len(self.hosts)):
            host, port = self.hosts[(gw + attempt) % len(self.hosts)]
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                continue
            gw = (gw + attempt) % len(self.hosts)
            c.gateway = gw
            try:
                await self.http_stream(c, reader, writer)
            finally:
                writer.transport.abort()
            return gw
        c.fail("connect refused (every gateway)")
        return gw

    async def http_stream(
        self, c: Call, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        body = self.body(c)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        buf = b""
        while (i := buf.find(b"\r\n\r\n")) < 0:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed before the response head")
            buf += data
        head, buf = buf[:i].decode("latin-1").lower(), buf[i + 4 :]
        status = int(head[9:12])
        for line in head.split("\r\n"):
            if line.startswith("x-request-id:"):
                c.request_id = line.split(":", 1)[1].strip()
        chunked = "transfer-encoding: chunked" in head
        sse = b""
        while True:
            while chunked and (j := buf.find(b"\r\n")) >= 0:  # de-chunk what is complete
                size = int(buf[:j], 16)
                if len(buf) < j + 2 + size + 2:
                    break
                sse += buf[j + 2 : j + 2 + size]
                buf = buf[j + 2 + size + 2 :]
                if size == 0:
                    chunked = False
            if not chunked:
                sse, buf = sse + buf, b""
            if status != 200:
                data = await reader.read(65536)
                if data:
                    buf += data
                    continue
                code = ""
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = json.loads(sse)["error"]["code"]
                c.fail(f"http {status} {code}".strip())
                return
            *events, sse = sse.split(b"\n\n")
            for ev in events:
                if self.on_event(c, ev):
                    return
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed mid-stream")
            buf += data

    def on_event(self, c: Call, ev: bytes) -> bool:
        """One SSE event; True when the stream is over."""
        if not ev.startswith(b"data: "):
            return False
        if ev == b"data: [DONE]":
            c.status = "ok" if c.status == "running" else c.status
            return True
        obj = json.loads(ev[6:])
        if "error" in obj:
            c.fail(f"sse {obj['error'].get('code')}")
            return True
        now = time.perf_counter()
        for ch in obj.get("choices") or []:
            text = (ch.get("delta") or {}).get("content")
            if ch.get("finish_reason") is None and text is not None:
                c.texts.append(text)
                c.times.append(now)
        if obj.get("usage"):
            c.usage = obj["usage"]["completion_tokens"]
        return False

    async def nats_call(self, c: Call) -> None:
        from libs.client import StraitError

        greedy: dict[str, Any] = {"temperature": 0.0} if self.prompts else {}
        gen = self.client.generate(
            messages=[{"role": "user", "content": c.prompt}],
            model=self.model,
            max_tokens=self.opts.max_tokens,
            ignore_eos=True,
            seed=c.seed,
            **greedy,
        )
        c.request_id = gen.request_id
        try:
            async with gen:
                async for d in gen:
                    if d.token_ids:
                        c.texts.append(d.text)
                        c.times.append(time.perf_counter())
            c.usage = gen.usage.completion_tokens if gen.usage else None
            c.status = "ok"
        except StraitError as e:
            c.fail(f"nats {e.code}")
        finally:
            c.migrations = gen.migrations

    async def slot(self, i: int) -> None:
        # Starts spread over one request's duration, so ends (and drains) are spread too.
        await asyncio.sleep(i / self.opts.streams * self.opts.max_tokens * self.opts.per_token_s)
        nats_path = self.opts.nats_every and i % self.opts.nats_every == self.opts.nats_every - 1
        gw = i % len(self.hosts)
        while not self.stop_new:
            k = len(self.calls)
            c = Call(k, "nats" if nats_path else "http", seed=k)
            if self.prompts:
                c.fixed_prompt = self.prompts[k % len(self.prompts)]
            self.calls.append(c)
            c.t_send = time.perf_counter()
            try:
                if nats_path:
                    await asyncio.wait_for(self.nats_call(c), self.opts.bound)
                else:
                    gw = await asyncio.wait_for(self.http_call(c, gw), self.opts.bound)
            except TimeoutError:
                c.status = "hang"
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                c.fail(f"conn {type(e).__name__}: {e}"[:60])
            c.t_end = time.perf_counter()
            if c.status == "running":
                c.fail("ended without [DONE]")
            if c.status != "ok":
                await asyncio.sleep(0.2)  # do not spin on a refusal

    async def run(self, fault: Callable[[], Coroutine[Any, Any, None]] | None) -> float | None:
        """Load, the fault at ``fault_at``, no new requests ``after`` s later, all ended.
        Returns the fault's time (perf_counter), None without one."""
        import nats

        from libs.client import StraitClient

        nc = None
        if self.opts.nats_every:
            nc = await nats.connect(
                servers=server_urls(self.fleet.nats.url),
                name="chaos-load",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=quiet,  # a restarted server is expected here, not worth a traceback
            )
            self.client = StraitClient(nc, api_key_id="chaos")
        slots = [asyncio.create_task(self.slot(i)) for i in range(self.opts.streams)]
        await asyncio.sleep(self.opts.fault_at)
        t_fault = None
        fault_task: asyncio.Task[None] | None = None
        if fault is not None:
            t_fault = time.perf_counter()
            fault_task = asyncio.create_task(fault())
        await asyncio.sleep(self.opts.after)
        self.stop_new = True
        await asyncio.gather(*slots)
        if fault_task is not None:
            await fault_task
            t_fault = self.fleet.t_fault or t_fault  # the signal itself, when there was one
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 10)
        return t_fault


_REFERENCE: dict[tuple[str, int, int], str] = {}


async def reference(prompt: str, seed: int, max_tokens: int) -> str:
    """The text the FAKE engine streams for this prompt and seed (its own code, no sleeps)."""
    key = (prompt, seed, max_tokens)
    if key not in _REFERENCE:
        from libs.backend.fake import FakeBackend
        from libs.protocol import ChatMessage, SamplingParams
        from libs.settings import FakeEngineSettings

        fake = FakeBackend(FakeEngineSettings(per_token_s=0.0, per_prompt_token_s=0.0), MODEL)
        sampling = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
        p = fake.prepare(
            prompt=None,
            prompt_token_ids=None,
            messages=[ChatMessage("user", prompt)],
            sampling=sampling,
        )
        text = [ch.text async for ch in fake.generate("ref", p, sampling, "interactive")]
        _REFERENCE[key] = "".join(text)
    return _REFERENCE[key]


async def fetch_references(load: Load, bound: float) -> dict[str, str]:
    """Each of the load's fixed prompts run once, alone and uninterrupted, through the fleet's
    first gateway (before any load or fault): the text every request of that prompt must get."""
    refs: dict[str, str] = {}
    for p in load.prompts:
        c = Call(-1, "http", seed=0, fixed_prompt=p)
        await asyncio.wait_for(load.http_call(c, 0), bound)
        if c.status != "ok" or c.usage != load.opts.max_tokens:
            raise RuntimeError(f"reference for {p!r} failed: {c.status} {c.error} {c.usage}")
        refs[p] = "".join(c.texts)
    return refs
