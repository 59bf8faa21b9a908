"""``strait up`` as a bench runs it: a fleet from a config file, on ports and subjects of its own.

``bench.autoscaling``, ``bench.planner_timeline`` and ``bench.restarts`` start the whole fleet
the way an operator does (``python -m services.cli up``: supervisor, nats-server, router,
gateway, workers, the planner when the config enables it) and load it over NATS or HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.support.services import free_port

STOP_TIMEOUT_S = 60.0  # SIGINT, then this long for the supervisor to drain, then SIGKILL
POLL_S = 0.05  # how often the log is read for a line waited for
LOG_TAIL = 3000  # characters of the log an error carries


@dataclass(frozen=True)
class Up:
    """A running ``strait up``: its NATS URL and subject prefix, gateway port, process, files."""

    url: str
    prefix: str | None  # None: the settings' default
    gateway_port: int
    dir: Path  # strait.toml, state/ (SQLite ledger, nats-server store), up.log
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.dir / "up.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def wait_log(self, text: str, count: int = 1, timeout: float = 120.0) -> None:
        """Until ``text`` is in the log ``count`` times; ``RuntimeError`` (with the log's tail)
        when ``strait up`` exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while self.log.read_text().count(text) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-LOG_TAIL:]
                raise RuntimeError(f"no {text!r} in {self.log}:\n{tail}")
            time.sleep(POLL_S)


def up_env(
    config: Path, url: str, prefix: str | None, gateway_port: int, extra: dict[str, str]
) -> dict[str, str]:
    """This process's environment, pointed at ``config`` and its own NATS, subjects and state:
    no JSON logs, no fixed metrics ports, no DATABASE_URL (the ledger is SQLite); ``extra``
    last."""
    env = dict(os.environ)
    env.update(
        STRAIT_CONFIG=str(config),
        NATS_URL=url,
        STRAIT_STATE_DIR=str(config.parent / "state"),
        STRAIT_GATEWAY__PORT=str(gateway_port),
        STRAIT_TELEMETRY__LOG_JSON="false",
        STRAIT_SUPERVISOR__WORKER_METRICS_BASE_PORT="0",
        STRAIT_SUPERVISOR__METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    if prefix is not None:
        env["STRAIT_NATS__SUBJECT_PREFIX"] = prefix
    env.pop("DATABASE_URL", None)
    env.update(extra)
    return env


@contextmanager
def strait_up(
    config: str,
    prefix: str | None,
    name: str,
    start_timeout_s: float,
    env: dict[str, str] | None = None,
) -> Iterator[Up]:
    """Write ``config`` (a ``strait.toml``) to a fresh directory, run ``strait up`` on it with a
    nats-server and a gateway on free ports, and yield once its log says ``fleet ready``.

    Raises ``RuntimeError`` (with the log's tail) if it exits or is not ready within
    ``start_timeout_s``. On exit: SIGINT, and SIGKILL after ``STOP_TIMEOUT_S``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"strait-{name}-"))
    (tmp / "strait.toml").write_text(config)
    url, gateway_port = f"nats://127.0.0.1:{free_port()}", free_port()
    with open(tmp / "up.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up"],
            env=up_env(tmp / "strait.toml", url, prefix, gateway_port, env or {}),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    up = Up(url, prefix, gateway_port, tmp, proc)
    try:
        up.wait_log("fleet ready", 1, start_timeout_s)
        yield up
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
