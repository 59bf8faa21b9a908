"""The fault campaign's region scenarios (``python -m bench.chaos --scenarios region-workers,
region-nats,region-link``; docs/regions.md): the campaign's load, measurement and table
(bench/chaos/) on two regions instead of one fleet.

The fleet: two NATS clusters, "a" and "b", one server each, joined by a gateway whose link runs
through a TCP proxy of the harness (``LinkProxy``: it can cut the link and restore it); in each
region a router, two FAKE-engine workers and a gateway (processes ``router-a``, ``worker-a0``,
``worker-a1``, ``gateway-a``, and the same for b); one SQLite ledger, written by a's gateway
from the ledger's stream (which sources both regions' events). The load's streams alternate
between a's gateway and b's, all HTTP (a ``StraitClient`` slot would need the region's
subjects: ``--nats-every`` is ignored here).

- ``region-workers``: SIGKILL both of a's workers. a's open streams continue in b (migration by
  replay), a's new requests are placed in b.
- ``region-nats``: stop a's whole NATS cluster for ``REGION_DOWN_S``, then start it again (with
  its stores). b's clients must see nothing; a's gateway cannot reach the fleet meanwhile (its
  clients get typed errors: in a deployment they would be sent to b's gateway). Measured once
  the ledger has caught up (b's usage reaches the ledger's stream in a when a is back).
- ``region-link``: cut the gateway link for ``LINK_DOWN_S`` (both clusters up), then restore
  it. Each region serves its own clients from its own workers (local first): nothing crosses,
  nothing may fail; b's usage reaches the ledger when the link is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chaos.fleet import Fleet, Opts
from bench.chaos.load import Load
from bench.chaos.measure import Runner, router_consumer, run_scenario
from bench.support.procs import ProcessFleet
from bench.support.regions import Supercluster, fake_config, region_env
from bench.support.services import free_port

REGIONS = ["a", "b"]
WORKERS_PER_REGION = 2
REGION_DOWN_S = 10.0  # region-nats: seconds a's cluster stays stopped
LINK_DOWN_S = 10.0  # region-link: seconds the gateway link stays cut
CATCH_UP_S = 60.0  # bound on the wait for the ledger to hold every completed request


class LinkProxy:
    """TCP forwarding (its own thread and event loop) from ``listen`` ports to ``target``
    ports; ``cut`` drops every connection and refuses new ones until ``restore``."""

    def __init__(self, routes: dict[int, int]) -> None:
        self.routes = routes
        self.cut_now = False
        self.cuts = 0
        self.loop = asyncio.new_event_loop()
        self.conns: set[asyncio.StreamWriter] = set()
        self.thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)
        self.ready = threading.Event()

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the link proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def serve() -> None:
            for listen, target in self.routes.items():
                await asyncio.start_server(
                    lambda r, w, t=target: self._pipe_pair(r, w, t), "127.0.0.1", listen
                )
            self.ready.set()

        self.loop.run_until_complete(serve())
        self.loop.run_forever()

    async def _pipe_pair(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int
    ) -> None:
        if self.cut_now:
            writer.transport.abort()
            return
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.transport.abort()
            return
        if self.cut_now:  # cut while this connection was being made: it was not in ``conns``
            writer.transport.abort()
            w2.transport.abort()
            return
        self.conns |= {writer, w2}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, w2), pipe(r2, writer))
        self.conns -= {writer, w2}

    def cut(self) -> None:
        def _cut() -> None:
            self.cut_now = True
            self.cuts += 1
            for w in list(self.conns):
                w.transport.abort()

        self.loop.call_soon_threadsafe(_cut)

    def restore(self) -> None:
        def _restore() -> None:
            self.cut_now = False

        self.loop.call_soon_threadsafe(_restore)

    def stop(self) -> None:
        async def close() -> None:
            for w in list(self.conns):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


class RegionNats:
    """The campaign's ``fleet.nats`` for two regions: the supercluster and its link proxy.
    ``url``/``live_url``: a's servers (the ledger's stream is there), b's while a is down."""

    def __init__(self, tmp: Path) -> None:
        via = {r: free_port() for r in REGIONS}
        self.sc = Supercluster(tmp / "nats", REGIONS, via=via)
        self.link = LinkProxy({via[r]: self.sc.gateway_port[r] for r in REGIONS})

    @property
    def url(self) -> str:
        return self.sc.url("a")

    @property
    def live_url(self) -> str:
        return self.sc.url("a" if self.sc.clusters["a"].alive() else "b")

    @property
    def log_paths(self) -> list[Path]:
        return [p for c in self.sc.clusters.values() for p in c.log_paths]

    def start(self) -> None:
        self.link.start()
        self.sc.start()

    def stop(self) -> None:
        self.sc.stop()
        self.link.stop()


class RegionsFleet(Fleet):
    """bench.chaos's Fleet, as two regions (the load's gateways: a's, then b's)."""

    def __init__(self, tmp: Path, opts: Opts, **kw: Any) -> None:
        n = WORKERS_PER_REGION * len(REGIONS)
        super().__init__(
            tmp,
            opts,
            workers=n,
            nats=RegionNats(tmp),
            config=fake_config(opts.per_token_s),
            **kw,
        )
        self.rnats: RegionNats = self.nats  # type: ignore[assignment]

    def __enter__(self) -> Fleet:
        try:
            self.nats.start()
            self.pf = pf = ProcessFleet(self.tmp, self.nats.url, self.config, self.env)
            (self.tmp / "strait.toml").write_text(self.config)
            for r in REGIONS:
                env = region_env(
                    r,
                    REGIONS,
                    self.ledger.path,  # type: ignore[union-attr]
                    r == REGIONS[0],
                    {"NATS_URL": self.rnats.sc.url(r), "STRAIT_TELEMETRY__LOG_JSON": "true"},
                )
                port = self.metrics_port[f"router-{r}"] = free_port()
                pf.start(f"router-{r}", "router", {**env, "STRAIT_ROUTER__METRICS_PORT": str(port)})
                for i in range(WORKERS_PER_REGION):
                    name = f"worker-{r}{i}"
                    port = self.metrics_port[name] = free_port()
                    pf.start(
                        name,
                        "worker",
                        {
                            **env,
                            "STRAIT_WORKER__WORKER_ID": f"{r}-w{i}",
                            "STRAIT_WORKER__METRICS_PORT": str(port),
                        },
                    )
                gw = free_port()
                pf.start(f"gateway-{r}", "gateway", {**env, "STRAIT_GATEWAY__PORT": str(gw)})
                self.gateway_urls.append(f"http://127.0.0.1:{gw}")
            self.wait_live(120.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def region_procs(self, region: str, kind: str) -> list[str]:
        return [n for n in self.procs if n.startswith(f"{kind}-{region}")]


async def consumers(fleet: RegionsFleet) -> dict[str, Any]:
    """The routers' requests consumers of both regions, summed (bench.chaos's columns)."""
    out: dict[str, Any] = {"ack_pending": 0, "redelivered": 0, "pending": 0}
    for r in REGIONS:
        c = await router_consumer(fleet.rnats.sc.url(r), f"STRAIT_REQUESTS-{r}")
        if "error" in c:
            return c
        for k in out:
            out[k] += c[k]
    return out


async def caught_up(fleet: Fleet, load: Load) -> dict[str, Any]:
    """Wait (``CATCH_UP_S`` at most) until the ledger has a row for every completed request."""
    assert isinstance(fleet, RegionsFleet)
    t0 = time.monotonic()
    want = {c.request_id for c in load.calls if c.status == "ok" and c.request_id}
    rows: dict[str, Any] = {}
    while time.monotonic() - t0 < CATCH_UP_S:
        rows = await fleet.ledger.rows()
        if want <= set(rows):
            break
        await asyncio.sleep(0.5)
    return {
        "ledger_catch_up_s": round(time.monotonic() - t0, 1),
        "router_consumer": await consumers(fleet),
    }


Fault = Callable[[RegionsFleet], Awaitable[None]]


async def regions_scenario(name: str, opts: Opts, fault: Fault) -> dict[str, Any]:
    """``fault`` on a RegionsFleet under the campaign's load (HTTP only), measured once the
    ledger has caught up."""

    async def run(fleet: Fleet, load: Load) -> None:
        assert isinstance(fleet, RegionsFleet)
        await fault(fleet)

    return await run_scenario(
        name,
        replace(opts, nats_every=0),
        run,
        before_measure=caught_up,
        fleet_class=RegionsFleet,
    )


async def region_workers(opts: Opts) -> dict[str, Any]:
    async def fault(fleet: RegionsFleet) -> None:
        for w in fleet.region_procs("a", "worker"):
            fleet.signal(w, signal.SIGKILL)

    return await regions_scenario("region-workers", opts, fault)


async def region_nats(opts: Opts) -> dict[str, Any]:
    async def fault(fleet: RegionsFleet) -> None:
        fleet.mark_fault()
        await asyncio.to_thread(fleet.rnats.sc.stop_region, "a")
        print(f"[region-nats] a's cluster stopped for {REGION_DOWN_S:g} s", file=sys.stderr)
        await asyncio.sleep(REGION_DOWN_S)
        await asyncio.to_thread(fleet.rnats.sc.restart_region, "a")

    return await regions_scenario("region-nats", opts, fault)


async def region_link(opts: Opts) -> dict[str, Any]:
    async def fault(fleet: RegionsFleet) -> None:
        fleet.mark_fault()
        fleet.rnats.link.cut()
        print(f"[region-link] gateway link cut for {LINK_DOWN_S:g} s", file=sys.stderr)
        await asyncio.sleep(LINK_DOWN_S)
        fleet.rnats.link.restore()

    return await regions_scenario("region-link", opts, fault)


RUNNERS: dict[str, Runner] = {
    "region-workers": region_workers,
    "region-nats": region_nats,
    "region-link": region_link,
}
