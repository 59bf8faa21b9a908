"""A secured nats-server for tests and benches: the accounts and TLS that ``strait up --secure``
makes (libs.security), on a free port, for the duration of a test or bench run."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from bench.support.services import Unavailable, free_port, nats_binary, wait_port
from libs.security.fleet import SecureFleet
from libs.settings import Settings


@asynccontextmanager
async def secure_nats(
    settings: Settings, teams: dict[str, int | None]
) -> AsyncIterator[SecureFleet]:
    """Start the server for ``teams`` (name → requests per minute, None for the default);
    ``settings.nats`` becomes the fleet's (TLS URL, CA, the fleet's nkey)."""
    binary = nats_binary()
    if binary is None:
        raise Unavailable("nats-server")
    settings.nats.url = f"tls://127.0.0.1:{free_port()}"
    settings.nats.monitor_port = free_port()
    sf = SecureFleet(settings)
    for name, rpm in teams.items():
        sf.store.add(name, rpm=rpm)
    settings.nats = sf.prepare()
    server = _start(binary, sf)
    try:
        assert wait_port(sf.port), (sf.dir / "nats.log").read_text()[-2000:]
        yield sf
    finally:
        server.terminate()
        await asyncio.to_thread(server.wait, 10)


def _start(binary: str, sf: SecureFleet) -> subprocess.Popen[bytes]:
    with open(sf.dir / "nats.log", "ab") as log:
        return subprocess.Popen([binary, "-c", str(sf.conf)], stdout=log, stderr=log)


def team_options(sf: SecureFleet, team: str) -> dict[str, Any]:
    """nats-py ``connect`` options of ``team``'s clients: its seed and the dev CA."""
    return {
        "nkeys_seed": str(sf.store.seed_file(team)),
        "tls": ssl.create_default_context(cafile=str(sf.tls.ca)),
    }
