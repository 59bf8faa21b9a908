"""A secured fleet on one machine: the files ``strait up --secure`` and ``strait teams`` share.

Under ``<state_dir>/secure`` (next to the teams file and seeds of ``teams``)::

    nats.conf   # server_config.render(...) for the current teams; rewritten on every change
    nats.pid    # the running nats-server's pid (its reload signal goes there)
    tls/        # the development CA and server certificate (tls.ensure_dev_tls)
    nats/       # JetStream's store

``SecureFleet.prepare`` makes what is missing and returns the NATS settings every fleet
process connects with (TLS URL, CA, the fleet's nkey). After editing the teams file,
``strait teams add|revoke`` calls ``ensure_streams`` (a new team's requests stream),
``apply`` (rewrite the config; the running server re-reads it and a removed user's
connections close at once; returns once the server serves every active team) and
``announce`` (``TeamsChanged`` to the routers and workers, so a revoked team's queued and
running requests end).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from libs.protocol import Subjects, TeamsChanged, encode
from libs.security.server_config import grants, render, team_account
from libs.security.teams import TeamStore, secure_dir
from libs.security.tls import TlsFiles, ensure_dev_tls
from libs.settings import NatsSettings, Settings
from libs.wire.nats_util import connect, ensure_team_streams

# Seconds `apply` waits for the server to show a change, polling every POLL_S; one request to
# the monitoring endpoint waits MONITOR_TIMEOUT_S.
APPLY_TIMEOUT_S = 10.0
POLL_S = 0.01
MONITOR_TIMEOUT_S = 2.0


class SecureFleet:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = secure_dir(settings.state_dir).resolve()
        self.store = TeamStore(self.dir)
        self.conf = self.dir / "nats.conf"
        self.pid_file = self.dir / "nats.pid"
        url = urlparse(settings.nats.url.split(",")[0].strip())
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 4222
        self.monitor_port = settings.nats.monitor_port

    @cached_property
    def tls(self) -> TlsFiles:
        """The development CA and server certificate (made or checked once per instance)."""
        return ensure_dev_tls(self.dir / "tls", [self.host, "localhost", "127.0.0.1"])

    def write_config(self, staged: frozenset[str] = frozenset()) -> Path:
        """The server's config for the teams file; ``staged`` teams' accounts without a user."""
        text = self.config_text(staged)
        tmp = self.conf.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.conf)
        return self.conf

    def config_text(self, staged: frozenset[str] = frozenset()) -> str:
        """``write_config``'s text (``strait teams config`` prints it for other servers)."""
        tf = self.store.ensure_fleet()
        store = self.dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        return render(
            prefix=self.settings.nats.subject_prefix,
            fleet_public_key=tf.fleet_public_key,
            teams=tf.teams,
            listen=f"{self.host}:{self.port}",
            max_payload=self.settings.nats.max_payload,
            store_dir=store,
            tls=self.tls,
            pid_file=self.pid_file,
            monitor=f"{self.host}:{self.monitor_port}" if self.monitor_port else "",
            staged=staged,
        )

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

    def apply(self, nats_server: str, timeout_s: float = APPLY_TIMEOUT_S) -> bool:
        """Have the running server take the teams file; False when no server runs (the config
        is written for the next start). Returns once the server holds exactly the active
        teams' accounts and each one's imports answer, so a team added here is served on its
        first request. A team new to the server is introduced in two reloads: its account
        staged (no user) first, then its user (server_config's docstring says why)."""
        if not self.pid_file.exists():
            self.write_config()
            return False
        active = [t.name for t in self.store.load().active()]
        known = set(self._monitor("/accountz").get("accounts") or [])
        new = frozenset(t for t in active if team_account(t) not in known)
        if new:
            self.write_config(staged=new)
            self._reload(nats_server)
            self._wait(lambda: new <= self._accounts_live(), timeout_s, "staged accounts")
        self.write_config()
        self._reload(nats_server)
        self._wait(lambda: self._serves(active), timeout_s, "the teams' imports")
        return True

    def _reload(self, nats_server: str) -> None:
        if not self.reload_server(nats_server):
            raise RuntimeError(f"nats-server did not take the reload signal ({self.pid_file})")

    def _monitor(self, path: str) -> dict[str, Any]:
        url = f"http://{self.host}:{self.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=MONITOR_TIMEOUT_S) as r:
                return dict(json.load(r))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RuntimeError(
                f"the server's monitoring endpoint {url} did not answer ({e}); "
                "is nats.monitor_port the running server's?"
            ) from e

    def _accounts_live(self) -> set[str]:
        """The teams whose account the server holds now."""
        accounts = self._monitor("/accountz").get("accounts") or []
        prefix = team_account("")
        return {a[len(prefix) :] for a in accounts if a.startswith(prefix)}

    def _serves(self, teams: list[str]) -> bool:
        """The server holds the accounts of ``teams`` and no other team's, and each one's
        service imports are subscribed (what a fresh account lacks after one reload)."""
        if self._accounts_live() != set(teams):
            return False
        prefix = self.settings.nats.subject_prefix
        for team in teams:
            subs = self._monitor(f"/subsz?subs=1&acc={quote(team_account(team))}")
            have = {s.get("subject") for s in subs.get("subscriptions_list") or []}
            if not all(local in have for _, local in grants(prefix, team).services):
                return False
        return True

    @staticmethod
    def _wait(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not take the new config ({what}) in time")
            time.sleep(POLL_S)

    async def ensure_streams(self, teams: list[str]) -> None:
        """Each team's requests stream, as the fleet."""
        nc = await connect(self.fleet_nats(), "strait-teams")
        try:
            await ensure_team_streams(nc.jetstream(), self.settings.nats, teams)
        finally:
            await nc.close()

    async def announce(self, revoked: list[str]) -> None:
        """``TeamsChanged`` to the fleet's routers and workers, as the fleet."""
        nc = await connect(self.fleet_nats(), "strait-teams")
        try:
            subject = Subjects.of(self.settings.nats).teams_changed
            await nc.publish(subject, encode(TeamsChanged(revoked=revoked)))
            await nc.flush()
        finally:
            await nc.close()
