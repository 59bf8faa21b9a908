"""The process table of ``strait up``: which processes a settings file asks for (``plan``: the
router, the cache service for disaggregated pools, each pool's workers by role, the gateway, the
planner and its warm standbys, refilled one at a time), their environment (``child_env``:
NATS, database, compile cache, the worker's id, role and /metrics port), the planner's word
applied (``scale``: new or activated workers, the newest surplus drained and not restarted) and
stopping them all (``stop_all``: SIGTERM, wait, then SIGKILL; the nats-server last). A child's
restarts are its own (``children.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.settings import Settings
from services.supervisor.children import Child, say
from services.supervisor.nats_server import ensure_nats, port_open

STOP_GRACE_S = 15.0
# The user's own inductor cache, read before anything imports torch (torch writes its default
# into the environment); otherwise compiled graphs go under the state dir.
USER_INDUCTOR_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
# The user's own kernel build directory; otherwise Settings.kernels_cache_dir.
USER_EXTENSIONS_DIR = os.environ.get("TORCH_EXTENSIONS_DIR")


# The variable a worker child reads its worker id from (its beats' ``worker_id``).
WORKER_ID_ENV = "STRAIT_WORKER__WORKER_ID"


def surplus(live: list[Child], n: int, drain_order: Sequence[str]) -> list[Child]:
    """The ``n`` workers of ``live`` (oldest first) a scale-down drains: those the planner has
    not heard beat yet (``drain_order``: starting, so idle), the newest first; then the
    planner's order (fewest requests first). Without an order: the newest."""
    if n <= 0:
        return []
    rank = {wid: i for i, wid in enumerate(drain_order)}
    # A stable sort: equal ranks (the unheard ones, -1) stay newest first.
    order = sorted(live[::-1], key=lambda c: rank.get(c.env.get(WORKER_ID_ENV, ""), -1))
    return order[:n]


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
    # When the next replacement standby of each (pool, role) may start loading
    # (planner.standby_refill_s after the last activation or refill: one at a time).
    refill_at: dict[tuple[str, str], float] = field(default_factory=dict)
    # Standbys that said they have loaded (WorkerStarting "standby", through the local
    # actuator): worker id → the pid that said it. Only those are activated.
    loaded: dict[str, int] = field(default_factory=dict)

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["STRAIT_PARENT_PID"] = str(os.getpid())
        env["NATS_URL"] = self.settings.nats.url
        env["DATABASE_URL"] = self.settings.database_url
        env.setdefault("STRAIT_TELEMETRY__LOG_JSON", "false")
        env.update(self.secure_env)
        # Compiled graphs (engine.compile) live with the fleet's state, warmed by warm_pools.
        env["TORCHINDUCTOR_CACHE_DIR"] = USER_INDUCTOR_DIR or str(self.settings.compile_cache_dir)
        env["TORCH_EXTENSIONS_DIR"] = USER_EXTENSIONS_DIR or str(self.settings.kernels_cache_dir)
        env.update(extra)
        return env

    def ensure_nats(self, secure: bool = False) -> None:
        local = ensure_nats(self.settings, secure)
        self.nats_proc, self.secure_env = local.proc, local.env

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

    def standby_loaded(self, worker_id: str, pid: int) -> None:
        """The standby ``worker_id`` (process ``pid``) has loaded (the local actuator heard it)."""
        self.loaded[worker_id] = pid

    def activate_standby(self, pool: str, role: str) -> Child | None:
        """Turn one standby worker of the pool role that has loaded (``standby_loaded``, by
        this very process) into a serving one (SIGUSR1) and owe the pool role a new standby
        (``refill_standby``); None when none has loaded: a standby still loading is not
        counted as serving, and the caller starts a worker instead."""
        ready = [
            c
            for c in self.children
            if c.pool == pool
            and c.role == role
            and c.standby
            and c.alive()
            and c.proc is not None
            and self.loaded.get(c.env.get(WORKER_ID_ENV, "")) == c.proc.pid
        ]
        if not ready:
            return None
        c = ready[0]
        assert c.proc is not None
        del self.loaded[c.env[WORKER_ID_ENV]]  # a parked one says so again
        c.proc.send_signal(signal.SIGUSR1)
        c.standby = False
        # Restarted after a crash it must serve, not wait again.
        c.env["STRAIT_WORKER__STANDBY"] = "false"
        c.name = c.name.removesuffix(" (standby)")
        self.refill_at[(pool, role)] = time.monotonic() + self.settings.planner.standby_refill_s
        return c

    def refill_standby(self, now: float) -> None:
        """Start one standby in each pool role that has fewer than ``planner.warm_standby``
        (activations used them) once ``planner.standby_refill_s`` has passed since the last
        activation or refill there: a replacement loads its model on the machine's cores, so
        it waits for the wave that used its predecessor, and several load one after another."""
        for key in list(self.refill_at):
            if now < self.refill_at[key]:
                continue
            if self.standbys(*key) >= self.settings.planner.warm_standby:
                del self.refill_at[key]  # refilled: nothing owed until the next activation
                continue
            spare = self.worker_child(*key, standby=True)
            self.children.append(spare)
            spare.start()
            say(f"planner: started {spare.name} (pid {spare.proc.pid if spare.proc else '?'})")
            self.refill_at[key] = now + self.settings.planner.standby_refill_s

    def standbys(self, pool: str, role: str) -> int:
        return sum(
            1
            for c in self.children
            if (c.pool, c.role) == (pool, role) and c.standby and not c.given_up
        )

    def park(self, c: Child) -> None:
        """Send a serving worker back to warm standby (SIGUSR2: it drains as for SIGTERM, stops
        beating and waits, loaded, for SIGUSR1): a scale-down that the next scale-up undoes
        with a signal, not a start-up."""
        assert c.proc is not None
        c.proc.send_signal(signal.SIGUSR2)
        c.standby = True
        c.env["STRAIT_WORKER__STANDBY"] = "true"  # restarted after a crash: a standby again
        c.name += " (standby)"

    def scale(
        self,
        pool: str,
        role: str,
        replicas: int,
        reason: str,
        drain_order: Sequence[str] = (),
    ) -> None:
        """The local actuator's word (services/planner/actuators.py): start workers up to
        ``replicas`` (warm standbys first), or drain the surplus (``surplus``): back to standby
        while the pool role has fewer than ``planner.warm_standby`` (``park``), else for good
        (SIGTERM: no new work, running requests finish or migrate, then the process exits and
        is not restarted)."""
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
        for c in surplus(live, len(live) - replicas, drain_order):
            if (
                c.alive()
                and c.proc is not None
                and self.standbys(pool, role) < self.settings.planner.warm_standby
            ):
                self.park(c)
                say(f"planner: parking {c.name} ({reason})")
                continue
            c.retiring = True
            if c.alive() and c.proc is not None:
                c.proc.send_signal(signal.SIGTERM)
            say(f"planner: draining {c.name} ({reason})")

    def start_all(self) -> None:
        for c in self.children:
            c.start()
            say(f"started {c.name} (pid {c.proc.pid if c.proc else '?'})")

    def watch(self) -> None:
        """Forget the drained workers that exited; restart or give up the others that did
        (``Child.watch``)."""
        for c in [c for c in self.children if c.retiring and not c.alive()]:
            self.children.remove(c)
            code = c.proc.returncode if c.proc is not None else None
            say(f"{c.name} drained and exited ({code})")
        now = time.monotonic()
        self.refill_standby(now)
        for c in self.children:
            c.watch(self.settings.supervisor, now)

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
