"""A secured fleet in the test's event loop: a nats-server of its own configured from the
generated accounts and TLS (libs.security), a router and a FAKE worker on the fleet's nkey,
the ledger writer on SQLite, and teams ``alpha``, ``beta`` (2 requests a minute) and ``gamma``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.support.fleet import InProcessFleet, running_fleet
from bench.support.secure import secure_nats
from bench.support.services import isolated_settings
from libs.client import StraitClient
from libs.db import Database
from libs.db.ledger import LedgerWriter
from libs.security.fleet import SecureFleet
from libs.settings import Settings
from libs.wire.nats_util import connect
from tests.integration.gateway.conftest import _pg_schema as pg_schema


@dataclass
class SecuredFleet:
    settings: Settings
    sf: SecureFleet
    fleet: InProcessFleet
    ledger_db: Database

    @property
    def url(self) -> str:
        return self.settings.nats.url

    def client(self, team: str, **kwargs: object) -> StraitClient:
        """A client as ``team`` would run it: its seed file, the CA, the plain prefix."""
        return StraitClient(
            self.url,
            prefix=self.settings.nats.subject_prefix,
            nkey_seed_file=str(self.sf.store.seed_file(team)),
            tls_ca_file=self.settings.nats.tls_ca_file,
            **kwargs,  # type: ignore[arg-type]
        )


@pytest.fixture
def secure_settings(tmp_path: Path) -> Iterator[Settings]:
    s = isolated_settings(tmp_path, "")  # secure_nats sets the URL
    s.gateway.auth_enabled = False
    s.pools[0].model = "fake-model"
    s.pools[0].backend = "fake"
    s.fake_engine.per_token_s = 0.002
    s.worker.beat_interval_s = 0.1
    s.teams.reload_interval_s = 0.1
    s.nats.request_dedupe_window_s = 1.0  # short enough to test past it
    yield s


@pytest.fixture
async def secured(secure_settings: Settings) -> AsyncIterator[SecuredFleet]:
    async with _secured(secure_settings) as f:
        yield f


@pytest.fixture(params=["sqlite", "postgres"])
async def secured_db(
    request: pytest.FixtureRequest, secure_settings: Settings
) -> AsyncIterator[SecuredFleet]:
    """``secured`` with its ledger on SQLite, then on PostgreSQL (a schema of its own)."""
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
        schema, drop = await pg_schema(url)
        secure_settings.database.url = url
        secure_settings.database.pg_schema = schema
        try:
            async with _secured(secure_settings) as f:
                yield f
        finally:
            await drop()
        return
    async with _secured(secure_settings) as f:
        yield f


@asynccontextmanager
async def _secured(s: Settings) -> AsyncIterator[SecuredFleet]:
    async with secure_nats(s, {"alpha": None, "beta": 2, "gamma": None}) as sf:
        db = Database(s)
        await db.migrate()
        async with running_fleet(s) as fleet:
            nc = await connect(s.nats, "test-ledger")
            ledger = LedgerWriter(s, nc.jetstream(), db)
            await ledger.start()
            try:
                yield SecuredFleet(s, sf, fleet, db)
            finally:
                await ledger.stop()
                await nc.close()
        await db.close()
