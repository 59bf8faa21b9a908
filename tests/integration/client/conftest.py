"""Fixtures of the NATS client tests: settings for a FAKE fleet, a running fleet, a client.

A test (or module) marked ``nats_modes("embedded", "secured")`` runs its ``fleet``/``client``
tests twice: against the embedded single-account server, and against a secured one
(accounts and TLS from libs.security, as ``strait up --secure`` makes them) with the client
connected as team ``team-test`` (its nkey seed and the dev CA; ``fleet.client_options`` holds
the same for raw nats-py clients). The tests themselves do not change.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.support.fleet import InProcessFleet, running_fleet
from bench.support.secure import secure_nats, team_options
from libs.client import StraitClient
from libs.settings import Settings

TEAM = "team-test"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "nats_mode" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("nats_modes")
        metafunc.parametrize("nats_mode", list(marker.args) if marker else ["embedded"])


@pytest.fixture
def fleet_settings(settings: Settings) -> Settings:
    settings.gateway.auth_enabled = False
    settings.pools[0].model = "fake-model"
    settings.pools[0].backend = "fake"
    settings.fake_engine.per_token_s = 0.002
    settings.worker.beat_interval_s = 0.1
    return settings


@pytest.fixture
async def fleet(fleet_settings: Settings, nats_mode: str) -> AsyncIterator[InProcessFleet]:
    """A router and one FAKE worker ``w1`` in pool ``default``."""
    if nats_mode == "embedded":
        async with running_fleet(fleet_settings) as f:
            yield f
        return
    async with secure_nats(fleet_settings, {TEAM: None}) as sf:
        async with running_fleet(fleet_settings) as f:
            f.client_options = team_options(sf, TEAM)
            f.team_seed_file = str(sf.store.seed_file(TEAM))
            yield f


@pytest.fixture
async def client(fleet: InProcessFleet) -> AsyncIterator[StraitClient]:
    if not fleet.team_seed_file:
        async with StraitClient.from_settings(fleet.settings, api_key_id="team-test") as c:
            yield c
        return
    n = fleet.settings.nats
    async with StraitClient(
        n.url,
        prefix=n.subject_prefix,
        api_key_id="team-test",
        nkey_seed_file=fleet.team_seed_file,
        tls_ca_file=n.tls_ca_file,
    ) as c:
        yield c
