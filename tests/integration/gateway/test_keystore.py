"""The gateway's key store: the KDF runs once per secret, revocations still land within the
verdict TTL (SQLite, and PostgreSQL where the fixture gives it)."""

from __future__ import annotations

import asyncio

import pytest

from libs.db import keys
from libs.db.keys import revoke_key
from libs.settings import Settings
from services.gateway.keystore import DatabaseKeyStore
from tests.integration.gateway.conftest import new_key

pytestmark = pytest.mark.integration

TTL_S = 0.05


async def test_a_secret_is_proven_once_and_revocation_still_lands(
    db_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = await new_key(db_settings, "proven")
    gateway = db_settings.gateway.model_copy(update={"key_cache_ttl_s": TTL_S})
    settings = db_settings.model_copy(update={"gateway": gateway})
    kdf_runs: list[str] = []
    real_check = keys.check_secret

    def counting_check(s: str, stored: str) -> bool:
        kdf_runs.append(s)
        return real_check(s, stored)

    monkeypatch.setattr(keys, "check_secret", counting_check)
    store = DatabaseKeyStore(settings)
    await store.start()
    try:
        for _ in range(3):  # each past the verdict TTL: a row lookup, the KDF only the first time
            info = await store.verify(secret)
            assert info is not None and info.name == "proven"
            await asyncio.sleep(TTL_S + 0.02)
        assert kdf_runs == [secret]
        forged = secret[:-4] + ("aaaa" if not secret.endswith("aaaa") else "bbbb")
        assert await store.verify(forged) is None  # same key id, wrong secret: checked, refused
        assert kdf_runs == [secret, forged]
        assert await revoke_key(settings, secret.split("-")[2])
        await asyncio.sleep(TTL_S + 0.02)
        assert await store.verify(secret) is None
    finally:
        await store.close()
