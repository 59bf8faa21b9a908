"""The one-machine fleet (`strait up`: one router, one aggregated worker, one gateway) losing a
process, as a user of `make run` sees it, on the FAKE engine (no model: a test of restarts,
routing and streaming).

    .venv/bin/python -m bench.restarts [--rounds 5] [--json out.json]

Every request is ``POST /v1/completions`` with ``stream: true`` through the gateway, greedy
(``temperature`` 0, ``ignore_eos``), ``MAX_TOKENS`` tokens of ``PER_TOKEN_S`` each. Scenarios:

- ``kill-worker``: one stream is running; ``kill -9`` of the worker ``KILL_AFTER_S`` into it.
  The supervisor restarts it; the stream must end with exactly the text of the same request run
  before the fault (one pause, no error). Then ``BURST`` streams are sent from ``BURST_FROM_S``
  to ``BURST_TO_S`` after the kill (the issue's 3–10 s, while the worker restarts): all must be
  served. Reported: the worker's restart (kill → beating), the stream's pause, the burst's
  time to first token.
- ``kill-router``: ``--rounds`` times, ``BURST`` streams sent over ``ROUTER_SPREAD_S`` with
  ``kill -9`` of the router ``ROUTER_KILL_AT_S`` in; each round waits for the restarted router
  first. Reported per round: completed of sent, the slowest request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.support.services import free_port

PER_TOKEN_S = 0.05
MAX_TOKENS = 160
KILL_AFTER_S = 2.0
BURST = 12
BURST_FROM_S, BURST_TO_S = 3.0, 10.0
ROUTER_SPREAD_S = 4.0
ROUTER_KILL_AT_S = 1.5
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 180.0

FLEET = f"""
[gateway]
auth_enabled = false
# The reference run and the measured one are the same request: no answer from the cache.
response_cache_enabled = false
[router]
metrics_port = 0
[fake_engine]
per_token_s = {PER_TOKEN_S}
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""


@dataclass
class Stream:
    text: str = ""
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    error: str = ""
    max_gap_s: float = 0.0
    gap_at: float = 0.0  # monotonic time the longest silence ended

    @property
    def ok(self) -> bool:
        return not self.error and self.end is not None


async def stream(client: httpx.AsyncClient, base: str, prompt: str) -> Stream:
    s = Stream(sent=time.monotonic())
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = s.sent
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"http {r.status_code} {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                data = line[6:]
                if data == "[DONE]":
                    s.end = now
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    s.error = f"sse {chunk['error'].get('code')}"
                    return s
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        if s.first is None:
                            s.first = now
                        elif now - last > s.max_gap_s:
                            s.max_gap_s, s.gap_at = now - last, now
                        last = now
                        s.text += c["text"]
    except httpx.HTTPError as e:
        s.error = f"conn {e!r}"
    return s


@dataclass
class Up:
    """`strait up` with the FAKE fleet (``config``; None: ``STRAIT_CONFIG``'s, with no auth)
    in a directory of its own (its state dir), on free ports."""

    tmp: Path
    proc: subprocess.Popen[bytes] | None = None
    gw_port: int = field(default_factory=free_port)
    config: str | None = FLEET
    ready_timeout_s: float = READY_TIMEOUT_S
    state_dir: Path | None = None  # None: a directory under ``tmp``

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gw_port}"

    @property
    def log(self) -> Path:
        return self.tmp / "up.log"

    def __enter__(self) -> Up:
        env = dict(os.environ)
        if self.config is not None:
            (self.tmp / "strait.toml").write_text(self.config)
            env["STRAIT_CONFIG"] = str(self.tmp / "strait.toml")
        else:
            env.update(STRAIT_GATEWAY__AUTH_ENABLED="false", STRAIT_ROUTER__METRICS_PORT="0")
        env.update(
            NATS_URL=f"nats://127.0.0.1:{free_port()}",
            STRAIT_STATE_DIR=str(self.state_dir or self.tmp / "state"),
            STRAIT_GATEWAY__PORT=str(self.gw_port),
            STRAIT_SUPERVISOR__WORKER_METRICS_BASE_PORT="0",
            STRAIT_SUPERVISOR__METRICS_PORT="0",
            PYTHONUNBUFFERED="1",
        )
        env.pop("DATABASE_URL", None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.wait_log("fleet ready", timeout=self.ready_timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def wait_log(self, text: str, count: int = 1, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.log.read_text().count(text) < count:
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"no {text!r} in {self.log}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def tree(self) -> list[psutil.Process]:
        assert self.proc is not None
        return psutil.Process(self.proc.pid).children(recursive=True)

    def child(self, command: str) -> psutil.Process:
        for p in self.tree():
            if p.cmdline()[-1:] == [command]:
                return p
        raise SystemExit(f"no {command} process under strait up")


async def wait_serving(base: str, timeout: float = READY_TIMEOUT_S) -> float:
    """Seconds until a short completion succeeds."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        while time.monotonic() - t0 < timeout:
            try:
                r = await c.post(
                    f"{base}/v1/completions",
                    json={"model": "default", "prompt": "ping", "max_tokens": 1},
                )
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the fleet did not serve again")


async def kill_worker(up: Up) -> dict[str, Any]:
    prompt = "the long answer"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        reference = await stream(client, up.base, prompt)
        assert reference.ok, reference.error
        running = asyncio.create_task(stream(client, up.base, prompt))
        await asyncio.sleep(KILL_AFTER_S)
        up.child("decode").kill()
        killed = time.monotonic()

        async def later(i: int) -> Stream:
            delay = BURST_FROM_S + i * (BURST_TO_S - BURST_FROM_S) / (BURST - 1)
            await asyncio.sleep(killed + delay - time.monotonic())
            return await stream(client, up.base, f"sent during the restart {i}")

        burst_tasks = [asyncio.create_task(later(i)) for i in range(BURST)]
        await asyncio.to_thread(up.wait_log, "worker ready", 2, 60)
        restarted = time.monotonic() - killed
        s = await running
        burst = await asyncio.gather(*burst_tasks)
    ttft = sorted(b.first - b.sent for b in burst if b.first is not None)
    return {
        "scenario": "kill-worker",
        "worker_process_restarted_s": round(restarted, 2),
        "stream_completed": s.ok,
        "stream_error": s.error,
        "stream_text_exact": s.text == reference.text,
        "stream_pause_s": round(s.max_gap_s, 2),
        "stream_resumed_after_kill_s": round(s.gap_at - killed, 2),
        "burst_sent": BURST,
        "burst_served": sum(b.ok for b in burst),
        "burst_errors": [b.error for b in burst if b.error],
        "burst_ttft_min_max_s": [round(ttft[0], 2), round(ttft[-1], 2)] if ttft else [],
    }


async def kill_router(up: Up, rounds: int) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for r in range(rounds):

            async def one(i: int, r: int = r) -> Stream:
                await asyncio.sleep(i * ROUTER_SPREAD_S / BURST)
                return await stream(client, up.base, f"round {r} request {i}")

            tasks = [asyncio.create_task(one(i)) for i in range(BURST)]
            await asyncio.sleep(ROUTER_KILL_AT_S)
            up.child("router").kill()
            results = await asyncio.gather(*tasks)
            await asyncio.to_thread(up.wait_log, "restarted router", r + 1, 90)
            slowest = max((s.end or 0) - s.sent for s in results)
            out.append(
                {
                    "round": r + 1,
                    "completed": sum(s.ok for s in results),
                    "sent": BURST,
                    "errors": [s.error for s in results if s.error],
                    "slowest_s": round(slowest, 2),
                }
            )
            await wait_serving(up.base)
    backoffs = [
        line.split("restarting ", 1)[1].split(" (", 1)[0]
        for line in up.log.read_text().splitlines()
        if line.startswith("[strait] router exited")
    ]
    return {"scenario": "kill-router", "rounds": out, "router_restarts": backoffs}


async def main_async(rounds: int) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="strait-restarts-") as d:
        with Up(Path(d)) as up:
            await wait_serving(up.base)
            results.append(await kill_worker(up))
            print(json.dumps(results[-1]), flush=True)
            await wait_serving(up.base)
            results.append(await kill_router(up, rounds))
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="router kills")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    results = asyncio.run(main_async(args.rounds))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
