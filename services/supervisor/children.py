"""One process ``strait up`` supervises, and its restart policy (``supervisor.*``).

A child that dies on its own is restarted: the first restart of a crash streak at once, the
next ones after an exponential back-off (``restart_backoff_s`` doubling up to
``restart_backoff_max_s``; the streak starts over after ``restart_reset_s`` of health); one that
exits more than ``restart_limit`` times within ``restart_window_s`` is given up alone, and the
rest of the fleet keeps serving. Restarts and give-ups are logged and counted on the
supervisor's ``/metrics`` (``supervisor.metrics_port``).
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from libs.settings import SupervisorSettings

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
        """Start the process. A worker (and any standby) starts with SIGUSR1 and SIGUSR2
        blocked (the mask survives exec): an activation or a park sent while it still imports
        and loads stays pending until the worker arms its handlers (services/worker/process.py
        ``arm_signals``), instead of ending the process by the signals' default action."""
        blocked = {signal.SIGUSR1, signal.SIGUSR2}
        old = (
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if self.standby or self.role else None
        )
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=False)
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
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

    def watch(self, policy: SupervisorSettings, now: float) -> None:
        """Start it when its pending restart is due; when it has just exited on its own, log
        it and schedule its restart, or give it up."""
        if self.given_up:
            return
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
                BACKOFF_SECONDS.labels(process=self.name).set(0)
                say(f"restarted {self.name} (pid {self.proc.pid if self.proc else '?'})")
            return
        if self.proc is None or self.proc.poll() is None:
            return
        code = self.proc.returncode
        delay = self.exited(policy, now)
        window = f"{len(self.exits)} exits within {policy.restart_window_s:g} s"
        if delay is None:
            GIVEN_UP.labels(process=self.name).set(1)
            say(
                f"{self.name} exited with {code}: {window}, over supervisor.restart_limit "
                f"({policy.restart_limit} per supervisor.restart_window_s); giving it up. "
                "The rest of the fleet keeps serving; restart `strait up` once it is fixed"
            )
            return
        RESTARTS.labels(process=self.name).inc()
        BACKOFF_SECONDS.labels(process=self.name).set(delay)
        when = "now" if delay == 0 else f"in {delay:g} s (supervisor.restart_backoff_s)"
        say(
            f"{self.name} exited with {code}; restarting {when} "
            f"({window}; given up past {policy.restart_limit})"
        )
