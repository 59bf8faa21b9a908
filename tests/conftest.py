"""Shared fixtures: real NATS and PostgreSQL, settings isolated per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.settings import Settings
from tests.support.services import missing, nats_server, unique_prefix


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A NATS URL of this test's own: ``TEST_NATS_URL`` (shared server, unique subjects) or a
    fresh nats-server on a free port."""
    url = os.environ.get("TEST_NATS_URL")
    if url:
        yield url
        return
    with nats_server(tmp_path) as u:
        yield u


@pytest.fixture
def settings(tmp_path: Path, nats_url: str) -> Settings:
    """Settings for one test: its own NATS subjects/streams, state dir and SQLite file."""
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
    s.router.metrics_port = 0
    s.worker.metrics_port = 0
    return s


@pytest.fixture
def postgres_url() -> str:
    """``TEST_DATABASE_URL`` (an asyncpg URL); skipped locally when unset, a failure in CI."""
    url = os.environ.get("TEST_DATABASE_URL")
    if not url:
        missing("PostgreSQL (TEST_DATABASE_URL)")
    assert url
    return url


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[object]:
    import nats

    conn = await nats.connect(settings.nats.url)
    try:
        yield conn
    finally:
        await conn.drain()
