"""JetStream nats-servers on this machine for the benches and tests: one server
(``NatsServer``), one cluster (``NatsCluster``; bench.chaos's ``nats-cluster`` scenario), and
clusters joined by gateways into a supercluster of regions (``bench.support.regions``)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.support.services import free_port, nats_binary, wait_port
from libs.wire.nats_util import server_urls


class NatsServer:
    """A JetStream nats-server on a fixed free port; ``restart`` keeps the port and the store."""

    def __init__(self, tmp: Path) -> None:
        binary = nats_binary()
        if binary is None:
            raise SystemExit("nats-server not found next to the Python executable (.venv/bin)")
        self.binary = binary
        self.port = free_port()
        self.store = tmp / "nats"
        self.store.mkdir(parents=True, exist_ok=True)
        self.conf = self.store / "nats.conf"
        self.conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\nmax_payload: {8 * 1024 * 1024}\n'
            f'jetstream {{ store_dir: "{self.store}" }}\n'
        )
        self.log = open(tmp / "nats-server.log", "ab")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def live_url(self) -> str:
        return self.url

    @property
    def log_paths(self) -> list[Path]:
        return [Path(self.log.name)]

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT
        )
        if not wait_port(self.port, 15):
            raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """A coroutine run to its end from synchronous code (also inside a running event loop)."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


class NatsCluster:
    """``n`` JetStream nats-servers on this machine forming one cluster: each with its own store
    dir, ``server_name`` ``n<i>``, client, cluster and monitoring ports, and routes to the others.
    ``start`` waits for a JetStream meta leader and creates Strait's streams with ``replicas``
    copies; ``url`` lists every server, comma-separated (``nats.url`` of the fleet)."""

    def __init__(
        self,
        tmp: Path,
        n: int = 3,
        replicas: int = 3,
        name: str = "strait-chaos",
        gateway_port: int = 0,
        gateways: dict[str, int] | None = None,
        gateway_advertise: int = 0,
    ) -> None:
        """``name``: the cluster's (a region's, in a supercluster); ``gateway_port`` and
        ``gateways`` (other cluster → the port its gateway is reached at): this cluster's
        gateway and the clusters it joins (bench.support.regions.Supercluster);
        ``gateway_advertise``: the port the others are told to reach this one at (a proxy)."""
        binary = nats_binary()
        if binary is None:
            raise SystemExit("nats-server not found next to the Python executable (.venv/bin)")
        self.binary, self.n, self.replicas, self.name = binary, n, replicas, name
        self.ports = [free_port() for _ in range(n)]
        self.cluster_ports = [free_port() for _ in range(n)]
        self.http_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.killed: list[int] = []
        self.confs: list[Path] = []
        tag = "" if name == "strait-chaos" else f"-{name}"
        self.logs = [open(tmp / f"nats-server{tag}{i}.log", "ab") for i in range(n)]
        self.info: dict[str, Any] = {}  # what the scenario saw of the cluster (for the JSON)
        gateway = ""
        if gateway_port:
            others = ", ".join(
                f'{{ name: "{g}", url: "nats://127.0.0.1:{p}" }}'
                for g, p in (gateways or {}).items()
            )
            advertise = (
                f'  advertise: "127.0.0.1:{gateway_advertise}"\n' if gateway_advertise else ""
            )
            gateway = (
                f'gateway {{\n  name: "{name}"\n  listen: "127.0.0.1:{gateway_port}"\n'
                f"{advertise}  gateways: [{others}]\n}}\n"
            )
        for i in range(n):
            store = tmp / f"nats{tag}{i}"
            store.mkdir(parents=True, exist_ok=True)
            # A one-server cluster names itself (JetStream clustering needs a route; a route
            # to oneself is dropped).
            routes = ", ".join(
                f'"nats://127.0.0.1:{p}"'
                for j, p in enumerate(self.cluster_ports)
                if j != i or n == 1
            )
            conf = store / "nats.conf"
            server = f"n{i}" if not tag else f"{name}{i}"
            conf.write_text(
                f'server_name: "{server}"\nlisten: "127.0.0.1:{self.ports[i]}"\n'
                f'http: "127.0.0.1:{self.http_ports[i]}"\nmax_payload: {8 * 1024 * 1024}\n'
                f'jetstream {{ store_dir: "{store}" }}\n'
                f'cluster {{\n  name: "{name}"\n  listen: "127.0.0.1:{self.cluster_ports[i]}"'
                f"\n  routes: [{routes}]\n}}\n{gateway}"
            )
            self.confs.append(conf)

    def node_url(self, i: int) -> str:
        return f"nats://127.0.0.1:{self.ports[i]}"

    @property
    def url(self) -> str:
        return ",".join(self.node_url(i) for i in range(self.n))

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    @property
    def live_url(self) -> str:
        return ",".join(self.node_url(i) for i in self.alive())

    @property
    def log_paths(self) -> list[Path]:
        return [Path(f.name) for f in self.logs]

    def start(self) -> None:
        self.launch()
        self.info["meta_leader_at_start"] = self.wait_meta_leader(30.0)
        run_sync(self.provision(30.0))

    def launch(self) -> None:
        """Start every server that is not running (with its store: a restart keeps it) and
        wait for their client ports."""
        for i in range(self.n):
            p = self.procs[i]
            if p is not None and p.poll() is None:
                continue
            self.procs[i] = subprocess.Popen(
                [self.binary, "-c", str(self.confs[i])],
                stdout=self.logs[i],
                stderr=subprocess.STDOUT,
            )
        for port in self.ports:
            if not wait_port(port, 15):
                raise RuntimeError(f"nats-server on {port} did not start")

    def monitor(self, i: int, path: str) -> dict[str, Any] | None:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.http_ports[i]}/{path}", timeout=1)
            return dict(r.json())
        except (httpx.HTTPError, ValueError):
            return None

    def meta_leader(self) -> str | None:
        """The JetStream meta leader every live server agrees on (None: no agreement yet)."""
        views = [(self.monitor(i, "jsz") or {}).get("meta_cluster") or {} for i in self.alive()]
        leaders = {v.get("leader") or "" for v in views}
        return leaders.pop() if len(leaders) == 1 and "" not in leaders else None

    def wait_meta_leader(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (leader := self.meta_leader()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the NATS cluster elected no JetStream meta leader")
            time.sleep(0.2)
        return leader

    async def provision(self, timeout: float) -> None:
        """Strait's streams with ``replicas`` copies (retried while the peers catch up)."""
        import nats

        from libs.settings import NatsSettings
        from libs.wire.nats_util import provision

        settings = NatsSettings(url=self.url, stream_replicas=self.replicas)
        nc = await nats.connect(servers=server_urls(self.url), name="chaos-provision")
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await provision(nc.jetstream(timeout=5), settings)
                    return
                except Exception as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"streams not created on the cluster: {e!r}") from e
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    def connections(self) -> list[list[str]]:
        """Names of the client connections on each server (the harness's own are ``chaos-*``);
        [] for a server that does not answer."""
        out = []
        for i in range(self.n):
            conns = (self.monitor(i, "connz?limit=4096") or {}).get("connections") or []
            out.append([str(c.get("name") or "") for c in conns])
        return out

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        self.killed.append(i)

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
