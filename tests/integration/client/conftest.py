"""Fixtures of the NATS client tests: settings for a FAKE fleet, a running fleet, a client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from libs.client import StraitClient
from libs.settings import Settings
from tests.integration.client.fleet_util import running_fleet
from tests.support.fleet import InProcessFleet


@pytest.fixture
def fleet_settings(settings: Settings) -> Settings:
    settings.gateway.auth_enabled = False
    settings.pools[0].model = "fake-model"
    settings.pools[0].backend = "fake"
    settings.fake_engine.per_token_s = 0.002
    settings.worker.beat_interval_s = 0.1
    return settings


@pytest.fixture
async def fleet(fleet_settings: Settings) -> AsyncIterator[InProcessFleet]:
    """A router and one FAKE worker ``w1`` in pool ``default``."""
    async with running_fleet(fleet_settings) as f:
        yield f


@pytest.fixture
async def client(fleet: InProcessFleet) -> AsyncIterator[StraitClient]:
    async with StraitClient.from_settings(fleet.settings, api_key_id="team-test") as c:
        yield c
