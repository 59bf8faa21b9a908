"""Fixtures for the benchmark tests: the fake OpenAI server of bench_fake_openai, served."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

# `bench` is a top-level folder of the repository, not an installed package.
ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_fake_openai import fake_app  # noqa: E402


@pytest.fixture(scope="session")
def fake_server() -> Iterator[str]:
    """Base URL of the fake server (uvicorn in a thread on a free loopback port)."""
    config = uvicorn.Config(fake_app(), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake OpenAI server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
