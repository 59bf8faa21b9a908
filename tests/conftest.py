"""Shared fixtures: real NATS and PostgreSQL, settings isolated per test; a service the harness
(``bench.support``) finds missing skips the test, or fails it with ``CI=true``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest

from bench.support.services import Unavailable, isolated_settings, nats_server
from libs.settings import Settings
from tests.support.services import missing

# Strait's CPU kernels build where `make kernels` and `strait up` build them (the state dir's
# torch_extensions, Settings.kernels_cache_dir), not in torch's directory shared by checkouts.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Settings().kernels_cache_dir))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    """A fixture's missing service (``Unavailable``) is the suite's ``missing``."""
    try:
        return (yield)
    except Unavailable as e:
        missing(str(e))
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A test body's missing service (``Unavailable``) is the suite's ``missing``."""
    try:
        return (yield)
    except Unavailable as e:
        missing(str(e))
        raise


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
    return isolated_settings(tmp_path, nats_url)


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
