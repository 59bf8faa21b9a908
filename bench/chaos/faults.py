"""The scenarios that kill, stop, drain or slow one process of a FAKE-engine fleet, restart its
nats-server, or flood every subject with malformed messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
from collections import Counter
from typing import Any

from bench.chaos.fleet import MODEL, Fleet, Opts
from bench.chaos.load import Load
from bench.chaos.measure import Runner, run_scenario
from libs.wire.nats_util import server_urls


async def kill_worker(opts: Opts) -> dict[str, Any]:
    """SIGKILL the aggregated worker with the most running requests."""

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal(await fleet.busiest_worker(), signal.SIGKILL)

    return await run_scenario("kill-worker", opts, fault)


async def sigstop_worker(opts: Opts) -> dict[str, Any]:
    """SIGSTOP the busiest worker for 5 s (past the router's 1.5 s TTL), then SIGCONT."""

    async def fault(fleet: Fleet, load: Load) -> None:
        w = await fleet.busiest_worker()
        fleet.signal(w, signal.SIGSTOP, ends_it=False)
        try:
            await asyncio.sleep(5.0)
        finally:
            fleet.signal(w, signal.SIGCONT, ends_it=False)

    return await run_scenario("sigstop-worker", opts, fault)


async def drain_worker(opts: Opts) -> dict[str, Any]:
    """SIGTERM the busiest worker with worker.drain_timeout_s = 1: what runs past it migrates."""

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal(await fleet.busiest_worker(), signal.SIGTERM)

    env = {i: {"STRAIT_WORKER__DRAIN_TIMEOUT_S": "1"} for i in range(3)}
    return await run_scenario("drain-worker", opts, fault, worker_env=env)


async def slow_worker(opts: Opts) -> dict[str, Any]:
    """One worker 5x slower per token than the others, for the whole run (no signal)."""
    env = {0: {"STRAIT_FAKE_ENGINE__PER_TOKEN_S": str(opts.per_token_s * 5)}}
    return await run_scenario("slow-worker", opts, None, worker_env=env)


async def kill_router(opts: Opts) -> dict[str, Any]:
    """Two routers sharing the requests consumer; SIGKILL the first. Measured after the
    consumer's ack wait (router.assign_timeout_s x 4 + 5 = 13 s), so a request the dead router
    held unacked has been redelivered to the other by then."""

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal("router", signal.SIGKILL)

    return await run_scenario("kill-router", opts, fault, settle=15.0, routers=2)


async def kill_gateway(opts: Opts) -> dict[str, Any]:
    """Two gateways, HTTP slots spread over both; SIGKILL the second. Its open streams break
    (failed, on the client side); the slots' next requests go to the other gateway."""

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal("gateway1", signal.SIGKILL)

    return await run_scenario("kill-gateway", opts, fault, gateways=2)


async def restart_nats(opts: Opts) -> dict[str, Any]:
    """Stop the nats-server (SIGTERM), start it again 1 s later: same port, same store dir."""

    async def fault(fleet: Fleet, load: Load) -> None:
        await asyncio.to_thread(fleet.nats.stop)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(fleet.nats.start)

    return await run_scenario("restart-nats", opts, fault)


WRONG_VALUES: list[Any] = [[], {}, "x" * 10, -1, 1e308, None, [1, "a"]]


def malformed_payloads(
    rng: random.Random, valid: dict[str, Any], n: int, oversized: bool = True
) -> list[bytes]:
    """``n`` payloads a decoder must refuse: random bytes, truncated JSON, a wrong ``v``,
    fields of the wrong type, other message types, and a few oversized ones (1-4 MB)."""
    raw = json.dumps(valid).encode()
    keys = list(valid)
    out: list[bytes] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(rng.randbytes(rng.randint(0, 300)))
        elif kind == 1:
            out.append(raw[: rng.randint(0, len(raw) - 1)])
        elif kind == 2:
            out.append(json.dumps(valid | {"v": rng.choice([0, 2, 999, "1", None])}).encode())
        elif kind == 3:  # every field in turn, with every wrong value in turn
            combo = i // 6
            bad = WRONG_VALUES[combo // len(keys) % len(WRONG_VALUES)]
            out.append(json.dumps(valid | {keys[combo % len(keys)]: bad}).encode())
        elif kind == 4:
            out.append(rng.choice([b"[]", b"null", b"1", b'"str"', b"{}", b'{"v":1}']))
        elif oversized and i % 600 == 5:
            out.append(b'{"v":1,"request_id":"' + b"A" * rng.randint(1, 4) * 2**20 + b'"}')
        else:
            out.append(raw.replace(b'"', b"'", rng.randint(1, 5)))
    return out


async def malformed(opts: Opts) -> dict[str, Any]:
    """Thousands of malformed messages on every subject the fleet listens on, under load."""
    from nats.aio.client import Client as NATS

    from libs.protocol import Subjects

    s = Subjects()
    rng = random.Random(7)
    request = {
        "v": 1,
        "request_id": "junk",
        "model": MODEL,
        "prompt": "x",
        "sampling": {"max_tokens": 2},
    }
    beat = {
        "v": 1,
        "worker_id": "w0",
        "pool": "default",
        "role": "aggregated",
        "model": MODEL,
        "running": 0,
    }
    cancel = {"v": 1, "request_id": "junk", "reason": "x"}
    assignment = {"v": 1, "request": request, "route": {"pool": "default", "worker_id": "w0"}}
    handoff = {"v": 1, "request_id": "junk", "transfer_id": "t"}
    per = max(1, opts.malformed // 8)

    async def fault(fleet: Fleet, load: Load) -> None:
        nc = NATS()
        await nc.connect(
            servers=server_urls(fleet.nats.url), name="chaos-malformed", max_reconnect_attempts=3
        )
        js = nc.jetstream()
        sent: Counter[str] = Counter()
        try:
            for p in malformed_payloads(rng, request, per * 2, opts.oversized):
                with contextlib.suppress(Exception):  # the stream may refuse an oversized one
                    await js.publish(s.requests, p, timeout=5)
                    sent["requests"] += 1
            targets: list[tuple[str, dict[str, Any], int]] = [
                (s.work(f"w{rng.randint(0, 2)}"), assignment, per * 2),
                (s.cancel(f"junk{rng.randint(0, 99)}"), cancel, per),
                (s.beat("default", "aggregated", "w0"), beat, per),
                (s.kv_events("w1"), beat, per // 2),
                (s.handoff_offer("w1"), handoff, per // 2),
                (s.handoff_commit("w2"), handoff, per // 2),
                (s.handoff_kv("w2", "t"), handoff, per // 2),
            ]
            for subject, valid, n in targets:
                for j, p in enumerate(malformed_payloads(rng, valid, n, opts.oversized)):
                    await nc.publish(subject, p)
                    sent[subject.split(".")[2]] += 1
                    if j % 200 == 0:
                        await nc.flush()
            await nc.flush()
        finally:
            await nc.close()
        print(f"[malformed] published {dict(sent)}", file=sys.stderr, flush=True)

    return await run_scenario("malformed", opts, fault)


RUNNERS: dict[str, Runner] = {
    "kill-worker": kill_worker,
    "sigstop-worker": sigstop_worker,
    "drain-worker": drain_worker,
    "slow-worker": slow_worker,
    "kill-router": kill_router,
    "kill-gateway": kill_gateway,
    "restart-nats": restart_nats,
    "malformed": malformed,
}
