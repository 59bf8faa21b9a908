"""Fixtures of the gateway tests: settings for FAKE workers and the database each test runs on
(SQLite, and PostgreSQL in its own schema). The fleet that stops fast is
``bench.support.fleet.GatewayFleet``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select

from libs.db import Database
from libs.db.keys import create_key
from libs.db.models import RequestRow
from libs.settings import Settings


@pytest.fixture
def gw_settings(settings: Settings) -> Settings:
    """Auth on, one FAKE pool ``default`` (model ``fake-model``), quick retries."""
    settings.pools[0].model = "fake-model"
    settings.pools[0].backend = "fake"
    settings.fake_engine.per_token_s = 0.001
    settings.fake_engine.per_prompt_token_s = 0.0
    settings.gateway.key_cache_ttl_s = 0.3
    settings.gateway.first_message_timeout_s = 10.0
    settings.gateway.idle_timeout_s = 10.0
    settings.database.ledger_retry_s = 0.2
    return settings


async def _pg_schema(url: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    import asyncpg

    schema = f"gw_{uuid.uuid4().hex[:12]}"
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()

    async def drop() -> None:
        c = await asyncpg.connect(dsn)
        try:
            await c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await c.close()

    return schema, drop


@pytest.fixture(params=["sqlite", "postgres"])
async def db_settings(
    request: pytest.FixtureRequest, gw_settings: Settings
) -> AsyncIterator[Settings]:
    """``gw_settings`` on SQLite, then on PostgreSQL (a schema of this test's own)."""
    if request.param == "sqlite":
        yield gw_settings
        return
    url = request.getfixturevalue("postgres_url")
    schema, drop = await _pg_schema(url)
    gw_settings.database.url = url
    gw_settings.database.pg_schema = schema
    try:
        yield gw_settings
    finally:
        await drop()


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 10.0, every: float = 0.05
) -> Any:
    """The first truthy result of ``check()`` within ``timeout`` seconds (else AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {got!r})")
        await asyncio.sleep(every)


async def ledger_rows(settings: Settings) -> dict[str, RequestRow]:
    db = Database(settings)
    try:
        await db.migrate()
        async with db.session() as s:
            rows = (await s.execute(select(RequestRow))).scalars().all()
        return {r.request_id: r for r in rows}
    finally:
        await db.close()


async def new_key(
    settings: Settings,
    name: str = "test",
    rpm: int | None = None,
    tpm: int | None = None,
    team: str | None = None,
) -> str:
    _, secret = await create_key(settings, name, rpm, tpm, team=team)
    return secret
