"""A service started by `strait up` must not outlive it: killed with SIGKILL, the supervisor
cannot stop its children, so each one watches its parent (``libs.runtime.watch_parent``) and
stops itself. The gateway runs under uvicorn, not ``run_service``, and once survived its
supervisor holding its port; here a stand-in supervisor starts it, is killed, and the gateway
must exit and free the port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.support.services import free_port
from services.supervisor.nats_server import port_open

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# PARENT_WATCH_INTERVAL_S (1 s) + uvicorn's graceful shutdown on a 2-core machine.
EXIT_BOUND_S = 15.0
READY_BOUND_S = 60.0
PROBE_S = 0.2  # a connect attempt to the gateway's port


def test_the_gateway_stops_when_its_supervisor_is_killed(tmp_path: Path, nats_url: str) -> None:
    port = free_port()
    pid_file = tmp_path / "gateway.pid"
    # The stand-in supervisor: starts the gateway as `strait up` does (STRAIT_PARENT_PID = its
    # own pid), writes the gateway's pid, and sleeps until killed.
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = dict(os.environ, STRAIT_PARENT_PID=str(os.getpid()))
        p = subprocess.Popen([sys.executable, "-m", "services.cli", "gateway"], env=env)
        open({str(pid_file)!r}, "w").write(str(p.pid))
        time.sleep(3600)
        """
    )
    env = dict(
        os.environ,
        NATS_URL=nats_url,
        STRAIT_GATEWAY__PORT=str(port),
        STRAIT_GATEWAY__AUTH_ENABLED="false",
        STRAIT_STATE_DIR=str(tmp_path / "state"),
        STRAIT_NATS__SUBJECT_PREFIX=f"pd{port}.v1",
    )
    env.pop("STRAIT_PARENT_PID", None)
    sup = subprocess.Popen([sys.executable, "-c", parent], env=env, cwd=ROOT)
    gateway_pid = None
    try:
        deadline = time.monotonic() + READY_BOUND_S
        while not (pid_file.exists() and port_open("127.0.0.1", port, PROBE_S)):
            assert sup.poll() is None and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.2)
        gateway_pid = int(pid_file.read_text())
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        deadline = time.monotonic() + EXIT_BOUND_S
        while alive(gateway_pid):
            assert time.monotonic() < deadline, "the gateway outlived its supervisor"
            time.sleep(0.2)
        assert not port_open("127.0.0.1", port, PROBE_S)
    finally:
        if sup.poll() is None:
            sup.kill()
        if gateway_pid is not None and alive(gateway_pid):
            os.kill(gateway_pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is reaped by init once its parent is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
