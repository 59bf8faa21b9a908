"""``strait up`` as a bench runs it: a fleet from a config file, on ports and subjects of its own.

``bench.autoscaling`` and ``bench.planner_timeline`` start the whole fleet the way an operator
does (``python -m services.cli up``: supervisor, nats-server, router, gateway, workers, the
planner when the config enables it) and replay a load against it over NATS.
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
POLL_S = 0.2  # how often the log is read for "fleet ready"
LOG_TAIL = 3000  # characters of the log an error carries


@dataclass(frozen=True)
class Up:
    """A running ``strait up``: its NATS URL and subject prefix, its files."""

    url: str
    prefix: str
    dir: Path  # strait.toml, state/ (SQLite ledger, nats-server store), up.log
    log: Path


def up_env(config: Path, url: str, prefix: str, gateway_port: int) -> dict[str, str]:
    """This process's environment, pointed at ``config`` and its own NATS, subjects and state:
    no JSON logs, no fixed metrics ports, no DATABASE_URL (the ledger is SQLite)."""
    env = dict(os.environ)
    env.update(
        STRAIT_CONFIG=str(config),
        NATS_URL=url,
        STRAIT_NATS__SUBJECT_PREFIX=prefix,
        STRAIT_STATE_DIR=str(config.parent / "state"),
        STRAIT_GATEWAY__PORT=str(gateway_port),
        STRAIT_TELEMETRY__LOG_JSON="false",
        STRAIT_SUPERVISOR__WORKER_METRICS_BASE_PORT="0",
        STRAIT_SUPERVISOR__METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    env.pop("DATABASE_URL", None)
    return env


@contextmanager
def strait_up(config: str, prefix: str, name: str, start_timeout_s: float) -> Iterator[Up]:
    """Write ``config`` (a ``strait.toml``) to a fresh directory, run ``strait up`` on it with a
    nats-server and a gateway on free ports, and yield once its log says ``fleet ready``.

    Raises ``RuntimeError`` (with the log's tail) if it exits or is not ready within
    ``start_timeout_s``. On exit: SIGINT, and SIGKILL after ``STOP_TIMEOUT_S``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"strait-{name}-"))
    (tmp / "strait.toml").write_text(config)
    up = Up(f"nats://127.0.0.1:{free_port()}", prefix, tmp, tmp / "up.log")
    env = up_env(tmp / "strait.toml", up.url, prefix, free_port())
    with open(up.log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up"], env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + start_timeout_s
        while "fleet ready" not in up.log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: fleet did not start:\n{up.log.read_text()[-LOG_TAIL:]}"
                )
            time.sleep(POLL_S)
        yield up
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
