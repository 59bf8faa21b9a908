"""The fault campaign's fleet: its options (``Opts``), configs, ledgers (SQLite, or a PostgreSQL
of its own) and processes (``Fleet``: nats-server, router, workers, gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_load import UNBOUNDED, UNBOUNDED_GATEWAY
from bench.support.nats_servers import NatsCluster, NatsServer, run_sync
from bench.support.procs import ProcessFleet
from bench.support.services import free_port, wait_gateway

MODEL = "fake-model"


ROUTE_RETRY = "Error trying to connect to route"


# The disaggregated scenarios (kill-decode, kill-prefill, kill-cache): the REAL engine on a tiny
# random-weight model (bench.support.tiny_models.save_tiny_model_dir), greedy requests, every
# request one of these prompts (their uninterrupted answers are fetched before the load).
TINY_MODEL = "tiny"


DISAGG_ENGINE = "ENGINE (tiny random-weight model)"


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
        for url in self.gateway_urls:
            wait_gateway(
                url, self.n_ready, deadline, f"gateway {url} never saw {self.n_ready} workers"
            )
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


Rows = dict[str, tuple[str, int, str]]  # request_id -> (status, completion_tokens, source)


ROWS_SQL = "SELECT request_id, status, completion_tokens, source FROM requests"


def ledger_rows(db: Path) -> Rows:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con:
            return {rid: (status, n, src) for rid, status, n, src in con.execute(ROWS_SQL)}
    except sqlite3.Error:
        return {}
