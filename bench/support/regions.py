"""Regions on this machine: NATS clusters joined by gateways into a supercluster, and a fleet
of separate processes in each (the integration test of docs/regions.md, bench/regions.py, the
fault campaign's region scenarios).

``Supercluster(tmp, ["a", "b"])`` writes one ``NatsCluster`` per region (``servers`` each, the
cluster named after the region, a gateway to every other); ``start`` launches them all and waits
until every server agrees on one JetStream meta leader. ``stop_region`` / ``restart_region``
stop a region's whole cluster and bring it back with its stores.

``RegionFleet(tmp, supercluster, region, config)`` is a ``ProcessFleet`` of the region: a router,
workers ``<region>-w<i>`` and a gateway, every process with ``STRAIT_NATS__REGION`` set and the
region's servers as its ``NATS_URL``; one SQLite ledger for every region (``ledger_db``),
written by the ledger region's gateway alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from nats.js.errors import ServiceUnavailableError

from bench.support.nats_servers import NatsCluster
from bench.support.procs import ProcessFleet
from bench.support.services import free_port, ready_workers
from libs.protocol import RouteDecision
from libs.wire.nats_util import server_urls


class Supercluster:
    def __init__(
        self, tmp: Path, regions: list[str], servers: int = 1, via: dict[str, int] | None = None
    ) -> None:
        """``via``: region → the port the other regions reach its gateway at (a proxy that
        forwards to ``gateway_port[region]``, which can cut the link); default: directly."""
        tmp.mkdir(parents=True, exist_ok=True)
        self.regions = list(regions)
        self.gateway_port = {r: free_port() for r in regions}
        reach = via or self.gateway_port
        self.clusters = {
            r: NatsCluster(
                tmp,
                n=servers,
                replicas=1,
                name=r,
                gateway_port=self.gateway_port[r],
                gateways={o: reach[o] for o in regions if o != r},
                gateway_advertise=reach[r] if via else 0,
            )
            for r in regions
        }

    def url(self, region: str) -> str:
        return self.clusters[region].url

    def start(self, timeout: float = 60.0) -> None:
        for c in self.clusters.values():
            c.launch()
        self.wait_meta_leader(timeout)

    def wait_meta_leader(self, timeout: float) -> str:
        """The JetStream meta leader every live server of every region agrees on."""
        deadline = time.monotonic() + timeout
        while True:
            leaders = {c.meta_leader() for c in self.clusters.values() if c.alive()}
            if len(leaders) == 1 and None not in leaders:
                leader = leaders.pop()
                assert leader is not None
                return leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"no JetStream meta leader agreed on: {leaders}")
            time.sleep(0.2)

    def stop_region(self, region: str) -> None:
        """Stop every server of ``region``'s cluster (SIGTERM, then SIGKILL)."""
        self.clusters[region].stop()

    def restart_region(self, region: str, timeout: float = 60.0) -> None:
        self.clusters[region].launch()
        self.wait_meta_leader(timeout)

    def stop(self) -> None:
        for c in self.clusters.values():
            c.stop()


def region_env(
    region: str, regions: list[str], ledger_db: Path, ledger: bool, env: dict[str, str]
) -> dict[str, str]:
    """What every process of ``region`` gets beside ProcessFleet's own environment."""
    return {
        "STRAIT_NATS__REGION": region,
        "STRAIT_NATS__REGIONS": "[" + ",".join(f'"{r}"' for r in regions) + "]",
        "DATABASE_URL": f"sqlite+aiosqlite:///{ledger_db}",
        "STRAIT_GATEWAY__LEDGER_ENABLED": "true" if ledger else "false",
        **env,
    }


class RegionFleet:
    """A region's router, ``workers`` fake or real workers and gateway, as processes."""

    def __init__(
        self,
        tmp: Path,
        supercluster: Supercluster,
        region: str,
        config_toml: str,
        workers: int = 2,
        ledger_db: Path | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.region = region
        self.worker_ids = [f"{region}-w{i}" for i in range(workers)]
        ledger_db = ledger_db or tmp.parent / "ledger.db"
        self.pf = ProcessFleet(
            tmp,
            supercluster.url(region),
            config_toml,
            region_env(
                region,
                supercluster.regions,
                ledger_db,
                region == supercluster.regions[0],
                env or {},
            ),
            [{"STRAIT_WORKER__WORKER_ID": w} for w in self.worker_ids],
            ready_timeout_s=ready_timeout_s,
        )

    @property
    def url(self) -> str:
        return self.pf.base_url

    def __enter__(self) -> RegionFleet:
        try:
            self.pf.__enter__()
        except BaseException:
            self.pf.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.pf.__exit__(None, None, None)

    def worker_names(self) -> list[str]:
        return [n for n in self.pf.procs if n.startswith("worker")]

    def kill_workers(self) -> None:
        """SIGKILL every worker of the region (their requests must move to another)."""
        for name in self.worker_names():
            p = self.pf.procs[name]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()

    def restart_workers(self) -> None:
        for i, name in enumerate(self.worker_names()):
            if self.pf.procs[name].poll() is not None:
                self.pf.start(name, "worker", {"STRAIT_WORKER__WORKER_ID": self.worker_ids[i]})

    def live_workers(self) -> int:
        """Workers the region's gateway sees (every region's: beats cross the gateways)."""
        return ready_workers(self.url)[1]

    def wait_workers(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.live_workers() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"region {self.region}'s gateway never saw {n} workers")
            time.sleep(0.2)


# ------------------------------------------------------------------ clients and evidence

FAKE_MODEL = "fake-model"


def fake_config(per_token_s: float, extra: str = "") -> str:
    """One pool of fake workers, the gateway unbounded (bench.gateway_load's), auth off."""
    from bench.gateway_load import UNBOUNDED, UNBOUNDED_GATEWAY

    return f"""{UNBOUNDED_GATEWAY}
[router]
max_pool_queue = {UNBOUNDED}

[fake_engine]
per_token_s = {per_token_s}
per_prompt_token_s = 0.0

[[pools]]
name = "default"
model = "{FAKE_MODEL}"
backend = "fake"
{extra}"""


@dataclass
class Call:
    """One streamed chat completion through a gateway, as its client saw it."""

    gateway: str  # the region whose gateway it was sent to
    prompt: str
    seed: int
    max_tokens: int
    request_id: str = ""
    texts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter of each text
    usage: int | None = None
    error: str = ""
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def ok(self) -> bool:
        return not self.error and self.usage == self.max_tokens


async def chat(
    http: httpx.AsyncClient, url: str, c: Call, temperature: float | None = None
) -> Call:
    """Stream ``c`` through the gateway at ``url`` (``ignore_eos``: exactly ``max_tokens``)."""
    body: dict[str, Any] = {
        "model": "auto",
        "messages": [{"role": "user", "content": c.prompt}],
        "max_tokens": c.max_tokens,
        "seed": c.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if temperature is not None:
        body["temperature"] = temperature
    c.t_send = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            c.request_id = r.headers.get("x-request-id", "")
            if r.status_code != 200:
                c.error = f"http {r.status_code}"
                return c
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    c.error = f"sse {obj['error'].get('code')}"
                    break
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content")
                    if ch.get("finish_reason") is None and text is not None:
                        now = time.perf_counter()
                        c.t_first = c.t_first or now
                        c.texts.append(text)
                        c.token_times.append(now)
                if obj.get("usage"):
                    c.usage = obj["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        c.error = f"broken: {e!r}"[:200]
    c.t_end = time.perf_counter()
    return c


async def route_events(
    url: str, stream: str = "STRAIT_EVENTS", subject: str = "strait.v1.events.route"
) -> dict[str, RouteDecision]:
    """request id → its last RouteDecision in ``stream`` (by default the ledger's, which holds
    every region's under the region-less subject)."""
    import nats

    nc = await nats.connect(servers=server_urls(url), name="regions-evidence")
    out: dict[str, RouteDecision] = {}
    try:
        js = nc.jetstream(timeout=10.0)
        deadline = time.monotonic() + 30.0
        while True:
            try:  # a meta leader being elected (a gateway link just back) answers 503
                info = await js.stream_info(stream)
                psub = await js.pull_subscribe(subject, stream=stream)
                break
            except ServiceUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        last = info.state.last_seq
        seq = info.state.first_seq
        while seq <= last and last > 0:
            try:
                msgs = await psub.fetch(256, timeout=2)
            except Exception:
                break
            for m in msgs:
                seq = m.metadata.sequence.stream + 1
                await m.ack()
                ev = msgspec.json.decode(m.data, type=RouteDecision)
                out[ev.request_id] = ev
        await psub.unsubscribe()
    finally:
        await nc.close()
    return out
