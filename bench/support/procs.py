"""The real fleet as separate processes (``strait <role>``), for end-to-end tests and benches.

``ProcessFleet(tmp, nats_url, config_toml, env)`` writes the config to a file, starts the router,
the workers and the gateway as subprocesses with ``STRAIT_CONFIG`` pointing at it, and waits for
the gateway's ``/ready``. Each process logs to ``tmp/<name>.log`` (shown when a test fails).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.support.services import free_port


@dataclass
class ProcessFleet:
    tmp: Path
    nats_url: str
    config_toml: str
    env: dict[str, str] = field(default_factory=dict)
    workers: list[dict[str, str]] = field(default_factory=lambda: [{}])
    # Extra processes before the workers: (name, CLI command, extra env), e.g. prefill, cache.
    extra_services: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    ready_timeout_s: float = 120.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    gateway_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def env_for(self, extra: dict[str, str]) -> dict[str, str]:
        """The environment a fleet process (or a `strait` command run against the fleet) gets."""
        env = dict(os.environ)
        env.update(
            STRAIT_CONFIG=str(self.tmp / "strait.toml"),
            NATS_URL=self.nats_url,
            DATABASE_URL=f"sqlite+aiosqlite:///{self.tmp / 'strait.db'}",
            STRAIT_STATE_DIR=str(self.tmp / "state"),
            STRAIT_GATEWAY__PORT=str(self.gateway_port),
            # No well-known port: a `make run` fleet beside the tests holds them.
            STRAIT_ROUTER__METRICS_PORT="0",
            STRAIT_CACHE__METRICS_PORT="0",
            STRAIT_PLANNER__METRICS_PORT="0",
            STRAIT_TELEMETRY__LOG_JSON="false",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        env.update(extra)
        return env

    def start(self, name: str, role: str, extra: dict[str, str] | None = None) -> None:
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", role],
            env=self.env_for(extra or {}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> ProcessFleet:
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.tmp / "strait.toml").write_text(self.config_toml)
        self.gateway_port = free_port()
        self.start("router", "router")
        for name, command, extra in self.extra_services:
            self.start(name, command, extra)
        for i, extra in enumerate(self.workers):
            self.start(f"worker{i}", "worker", {"STRAIT_WORKER__WORKER_ID": f"w{i}", **extra})
        self.start("gateway", "gateway")
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.logs(name)}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("fleet not ready:\n" + "\n".join(self.logs(n) for n in self.procs))

    def logs(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return f"--- {name} ---\n" + (
            path.read_text(errors="replace")[-4000:] if path.exists() else ""
        )

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
