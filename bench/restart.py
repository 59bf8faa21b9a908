"""``kill -9`` of the default fleet's worker while a request arrives every second: how long
until the fleet serves again, and whether the restarted worker loaded its saved graphs.

    .venv/bin/python -m bench.restart [--rounds 10] [--json out.json]

Starts ``strait up`` on ``configs/strait.toml`` (``STRAIT_CONFIG`` to change it; SmolLM2 with
``engine.compile``) with its own nats-server, gateway port and no well-known port, its state
(the compiled graphs under ``inductor/``) in ``--state`` (``.strait`` by default: graphs a
`make run` of this checkout compiled are reused; a first compile takes minutes). Then, each
round: a short chat request (``MAX_TOKENS`` tokens) every ``EVERY_S``; once one succeeds,
``kill -9`` of the worker; the round ends when the restarted worker is ready and a request
sent after the kill has succeeded. Printed per round: seconds from the kill to the first
request sent after it that was served, to the worker's ``worker ready``, requests that failed
(those open at the kill included), and what the restarted worker's log says of its graphs
(loaded, compiled, did not fit). Each kill is a one-off crash to the supervisor (restarted at
once, never given up: ``RESTART_POLICY``), as ten kills an hour apart would be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.support.up import Up, strait_up

EVERY_S = 1.0
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 3600.0
# strait up's restart policy for the bench: every kill restarted at once, none given up.
RESTART_POLICY = {
    "STRAIT_SUPERVISOR__RESTART_RESET_S": "1",
    "STRAIT_SUPERVISOR__RESTART_LIMIT": "1000",
}
SETTLE_S = 3.0  # between a round's end and the next kill
# What the worker's log says of its compiled graphs (libs/engine/aot.py).
GRAPH_LINES = {
    "loaded": re.compile(r"engine\.compile_aot: loaded \S+"),
    "did_not_fit": re.compile(r"does not fit this engine"),
    "compiled": re.compile(r"engine\.compile_aot: compiled the|compiling the \S+ graph in the"),
}


@dataclass
class Sent:
    at: float
    done: float | None = None
    status: int | str = ""


async def one(
    client: httpx.AsyncClient, base: str, i: str, log: list[Sent], ok: asyncio.Event
) -> None:
    s = Sent(time.monotonic())
    log.append(s)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"Say a number. Request {i}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    try:
        r = await client.post(f"{base}/v1/chat/completions", json=body)
        s.status = r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:120]}"
        if r.status_code == 200:
            ok.set()
    except httpx.HTTPError as e:
        s.status = repr(e)
    s.done = time.monotonic()


def graph_lines(text: str) -> dict[str, int]:
    return {k: len(p.findall(text)) for k, p in GRAPH_LINES.items()}


async def round_(up: Up, client: httpx.AsyncClient, n: int) -> dict[str, Any]:
    """One kill and what followed it."""
    sent: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    ok = asyncio.Event()  # a request was served

    async def arrivals(stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            # A prompt of its own: no answer from the gateway's response cache.
            tasks.append(asyncio.create_task(one(client, up.base_url, f"{n}.{i}", sent, ok)))
            i += 1
            await asyncio.sleep(EVERY_S)

    stop = asyncio.Event()
    feeder = asyncio.create_task(arrivals(stop))
    await ok.wait()
    before = up.log.read_text()
    ready_before = before.count("worker ready")
    tree = psutil.Process(up.proc.pid).children(recursive=True)
    worker = next(p for p in tree if "worker" in p.cmdline())
    worker.kill()
    killed = time.monotonic()
    served = ready = None
    while time.monotonic() - killed < ROUND_TIMEOUT_S:
        after = [s.done for s in sent if s.at > killed and s.status == 200 and s.done]
        if served is None and after:
            served = min(after) - killed
        if ready is None and up.log.read_text().count("worker ready") > ready_before:
            ready = time.monotonic() - killed
        if served is not None and ready is not None:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await feeder
    await asyncio.gather(*tasks)
    failed = [s.status for s in sent if s.status != 200]
    return {
        "round": n,
        "served_again_s": None if served is None else round(served, 1),
        "worker_ready_s": None if ready is None else round(ready, 1),
        "requests": len(sent),
        "failed": failed,
        "graphs": graph_lines(up.log.read_text()[len(before) :]),
    }


async def main_async(rounds: int, state: Path, config: str) -> list[dict[str, Any]]:
    results = []
    # A first start compiles the graphs before "fleet ready" (minutes on 2 cores).
    env = {
        "STRAIT_STATE_DIR": str(state),  # the machine's compiled graphs
        "STRAIT_GATEWAY__AUTH_ENABLED": "false",
        "STRAIT_ROUTER__METRICS_PORT": "0",
    }
    with strait_up(config, None, "restart", READY_TIMEOUT_S, env) as up:
        print(
            f"fleet ready at {up.base_url}; first start's graphs: {graph_lines(up.log.read_text())}"
        )
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            for n in range(1, rounds + 1):
                r = await round_(up, client, n)
                results.append(r)
                print(
                    f"round {n}: served again {r['served_again_s']} s after the kill, worker "
                    f"ready in {r['worker_ready_s']} s; {len(r['failed'])} of {r['requests']} "
                    f"requests failed; graphs {r['graphs']}",
                    flush=True,
                )
                await asyncio.sleep(SETTLE_S)
    within = sum(
        1 for r in results if r["served_again_s"] is not None and r["served_again_s"] <= 30
    )
    print(f"served again within 30 s in {within} of {len(results)} rounds")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--state", type=Path, default=Path(".strait"), help="strait up's state dir")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    os.environ.setdefault("STRAIT_CONFIG", "configs/strait.toml")
    os.environ.update(RESTART_POLICY)
    results = asyncio.run(
        main_async(args.rounds, args.state.resolve(), Path(os.environ["STRAIT_CONFIG"]).read_text())
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
