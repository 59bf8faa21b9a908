"""The cache service in-process on a real nats-server, and a CacheClient of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import nats
import pytest
from nats.aio.client import Client as NATS

from libs.settings import Settings
from libs.wire.kv_cache_client import CacheClient
from services.cache.service import CacheService
from tests.support.kv_blocks import block_bytes, random_blocks

BLOCK = block_bytes(random_blocks("m", 1))


@pytest.fixture
def cache_settings(settings: Settings) -> Settings:
    settings.cache.enabled = True
    settings.cache.memory_bytes = 64 * BLOCK
    settings.cache.lookup_timeout_s = 2.0
    settings.cache.fetch_timeout_s = 5.0
    settings.cache.metrics_port = 0
    return settings


@pytest.fixture
async def cache_service(cache_settings: Settings) -> AsyncIterator[CacheService]:
    conn = await nats.connect(cache_settings.nats.url)
    service = CacheService(conn, conn.jetstream(), cache_settings)
    await service.start()
    try:
        yield service
    finally:
        await service.close(drain_timeout_s=5.0)
        await conn.drain()


@pytest.fixture
async def client_nc(cache_settings: Settings) -> AsyncIterator[NATS]:
    conn = await nats.connect(cache_settings.nats.url)
    try:
        yield conn
    finally:
        await conn.drain()


@pytest.fixture
def cache(client_nc: NATS, cache_settings: Settings) -> CacheClient:
    return CacheClient(client_nc, cache_settings)


async def poll(pred: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
