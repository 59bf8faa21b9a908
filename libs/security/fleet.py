"""A secured fleet on one machine: the files ``strait up --secure`` and ``strait teams`` share.

Under ``<state_dir>/secure`` (next to the teams file and seeds of ``teams``)::

    nats.conf   # server_config.render(...) for the current teams; rewritten on every change
    nats.pid    # the running nats-server's pid (its reload signal goes there)
    tls/        # the development CA and server certificate (tls.ensure_dev_tls)
    nats/       # JetStream's store

``SecureFleet.prepare`` makes what is missing and returns the NATS settings every fleet
process connects with (TLS URL, CA, the fleet's nkey). After editing the teams file,
``strait teams add|revoke`` calls ``write_config`` (rewrite the config), ``reload_server``
(the running server re-reads it; a removed user's connections close at once) and
``announce`` (``TeamsChanged`` to the routers and workers, so a revoked team's queued and
running requests end).
"""

from __future__ import annotations

import subprocess
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from libs.nats_util import connect
from libs.protocol import Subjects, TeamsChanged, encode
from libs.security.server_config import render
from libs.security.teams import TeamStore, secure_dir
from libs.security.tls import TlsFiles, ensure_dev_tls
from libs.settings import NatsSettings, Settings


class SecureFleet:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = secure_dir(settings.state_dir).resolve()
        self.store = TeamStore(self.dir)
        self.conf = self.dir / "nats.conf"
        self.pid_file = self.dir / "nats.pid"
        url = urlparse(settings.nats.url.split(",")[0].strip())
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 4222

    @cached_property
    def tls(self) -> TlsFiles:
        """The development CA and server certificate (made or checked once per instance)."""
        return ensure_dev_tls(self.dir / "tls", [self.host, "localhost", "127.0.0.1"])

    def write_config(self) -> Path:
        tf = self.store.ensure_fleet()
        store = self.dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        text = render(
            prefix=self.settings.nats.subject_prefix,
            fleet_public_key=tf.fleet_public_key,
            teams=tf.teams,
            listen=f"{self.host}:{self.port}",
            max_payload=self.settings.nats.max_payload,
            store_dir=store,
            tls=self.tls,
            pid_file=self.pid_file,
        )
        tmp = self.conf.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.conf)
        return self.conf

    def prepare(self) -> NatsSettings:
        """Keys, certificates and config in place; the fleet processes' NATS settings."""
        self.write_config()
        return self.fleet_nats()

    def fleet_nats(self) -> NatsSettings:
        """The NATS settings every fleet process connects with: TLS, the CA, the fleet's key."""
        return self.settings.nats.model_copy(
            update={
                "url": f"tls://{self.host}:{self.port}",
                "nkey_seed_file": str(self.store.fleet_seed_file),
                "tls_ca_file": str(self.tls.ca),
            }
        )

    def reload_server(self, nats_server: str) -> bool:
        """Have the running server (its pid file) re-read the config; False when none runs."""
        if not self.pid_file.exists():
            return False
        r = subprocess.run(
            [nats_server, "--signal", f"reload={self.pid_file}"], capture_output=True, text=True
        )
        return r.returncode == 0

    async def announce(self, revoked: list[str]) -> None:
        """``TeamsChanged`` to the fleet's routers and workers, as the fleet."""
        nc = await connect(self.fleet_nats(), "strait-teams")
        try:
            subject = Subjects(self.settings.nats.subject_prefix).teams_changed
            await nc.publish(subject, encode(TeamsChanged(revoked=revoked)))
            await nc.flush()
        finally:
            await nc.close()
