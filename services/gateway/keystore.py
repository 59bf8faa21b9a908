"""``DatabaseKeyStore``: the gateway's ``KeyStore`` on the ``api_keys`` table.

Each verdict (a key, or "no such key") is remembered for ``gateway.key_cache_ttl_s``, so a
revocation takes effect within that many seconds and a busy key costs no query per request.
That a secret matches its key's stored hash is remembered longer (as long as the row keeps that
hash): a verdict past its TTL costs one row lookup, not the KDF again (the KDF, ~10-20 ms of
CPU, was run per request at one stream, on the cores that decode).
When the database cannot be reached, a key verified before keeps working (its last verdict is
reused); an unknown one gets 503. The cache holds at most ``MAX_ENTRIES`` verdicts, keyed by a
SHA-256 of the secret (never the secret itself).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict

from libs.db import Database
from libs.db.keys import find_key, key_id_of
from libs.log import fields
from libs.settings import Settings
from services.gateway.auth import KeyInfo
from services.gateway.errors import ApiError

log = logging.getLogger("strait.gateway")

MAX_ENTRIES = 10_000


class DatabaseKeyStore:
    def __init__(self, settings: Settings, db: Database | None = None) -> None:
        self.ttl_s = settings.gateway.key_cache_ttl_s
        self.db = db or Database(settings)
        self._verdicts: OrderedDict[bytes, tuple[KeyInfo | None, float]] = OrderedDict()
        # Secret digest → the stored hash it was proven against (bounded like the verdicts).
        self._proven: OrderedDict[bytes, str] = OrderedDict()

    async def start(self) -> None:
        await self.db.migrate()

    async def close(self) -> None:
        await self.db.close()

    async def verify(self, secret: str) -> KeyInfo | None:
        if key_id_of(secret) is None:
            return None
        digest = hashlib.sha256(secret.encode()).digest()
        now = time.monotonic()
        cached = self._verdicts.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            rec = await find_key(self.db, secret, self._proven.get(digest))
        except Exception as e:
            log.warning("key lookup failed", extra=fields(error=repr(e)[:300]))
            if cached is not None and cached[0] is not None:
                return cached[0]
            raise ApiError(
                503, "the key store is unavailable; retry shortly", "key_store_unavailable"
            ) from None
        self._proven.pop(digest, None)
        if rec is not None:
            self._proven[digest] = rec.secret_hash
            while len(self._proven) > MAX_ENTRIES:
                self._proven.popitem(last=False)
        info = None
        if rec is not None and not rec.revoked:
            info = KeyInfo(rec.key_id, rec.name, rec.rpm, rec.tpm, rec.team, rec.terms)
        self._verdicts[digest] = (info, now + self.ttl_s)
        self._verdicts.move_to_end(digest)
        while len(self._verdicts) > MAX_ENTRIES:
            self._verdicts.popitem(last=False)
        return info
