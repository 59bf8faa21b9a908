"""API keys: create, list, revoke, verify.

A secret reads ``sk-strait-<key id>-<random>``. Only a salted scrypt hash of the whole secret is
stored; verification finds the row by the id inside the secret and compares hashes in constant
time. The module-level functions open the database, migrate it and close it again (for the CLI
and ``strait up``); ``KeyRecord`` lookups on an open ``Database`` serve the gateway's key store.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from libs.db import Database
from libs.db.models import ApiKey
from libs.engine.params import PRIORITY_BANDS
from libs.protocol import Priority, valid_team
from libs.settings import Settings

SECRET_PREFIX = "sk-strait-"
DEV_KEY_NAME = "dev"
DEV_KEY_FILE = "dev-api-key"
# scrypt cost: the secrets carry 256 random bits, so the KDF guards a leaked table against
# nothing that brute force could reach anyway; keep verification cheap (a few ms).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**12, 8, 1


@dataclass(frozen=True)
class FlowTerms:
    """A key's terms in flow control (docs/flow-control.md); None: the defaults."""

    weight: float | None = None
    max_waiting: int | None = None
    priority: Priority | None = None


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    name: str
    rpm: int | None
    tpm: int | None
    revoked: bool
    secret_hash: str = ""  # the stored hash the secret was checked against
    team: str | None = None  # the team (docs/security.md) its requests bill as
    terms: FlowTerms = field(
        default_factory=FlowTerms
    )  # flow control's weight, waiting bound, best band


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.scrypt(
        secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"


def check_secret(secret: str, stored: str) -> bool:
    """Constant-time comparison of ``secret`` against a ``hash_secret`` string."""
    try:
        algo, n, r, p, salt_hex, digest_hex = stored.split("$")
        if algo != "scrypt":
            return False
        got = hashlib.scrypt(
            secret.encode(),
            salt=bytes.fromhex(salt_hex),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=len(digest_hex) // 2,
        )
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(got, bytes.fromhex(digest_hex))


def key_id_of(secret: str) -> str | None:
    """The key id inside a well-formed secret, else None."""
    if not secret.startswith(SECRET_PREFIX):
        return None
    key_id, sep, rest = secret[len(SECRET_PREFIX) :].partition("-")
    if not sep or not rest or not key_id.isalnum() or len(key_id) > 32:
        return None
    return key_id


def new_secret() -> tuple[str, str]:
    key_id = secrets.token_hex(6)
    return key_id, f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


# ---------------------------------------------------------------- on an open database


async def insert_key(
    db: Database,
    name: str,
    rpm: int | None,
    tpm: int | None,
    team: str | None = None,
    terms: FlowTerms | None = None,
) -> tuple[str, str]:
    if team is not None and not valid_team(team):
        raise ValueError(f"team name {team!r} must match [a-z][a-z0-9_-]{{0,31}}")
    terms = terms or FlowTerms()
    if terms.weight is not None and terms.weight <= 0:
        raise ValueError(f"weight must be > 0, not {terms.weight}")
    key_id, secret = new_secret()
    async with db.session() as s, s.begin():
        s.add(
            ApiKey(
                id=key_id,
                name=name,
                secret_hash=hash_secret(secret),
                rpm=rpm,
                tpm=tpm,
                team=team,
                weight=terms.weight,
                max_waiting=terms.max_waiting,
                priority=terms.priority,
                created_at=datetime.now(UTC),
            )
        )
    return key_id, secret


async def find_key(db: Database, secret: str, proven: str | None = None) -> KeyRecord | None:
    """The key this secret proves, revoked or not; None when it proves nothing. ``proven``: a
    stored hash this secret was already checked against; while the row still holds it, the
    KDF (~10-20 ms of CPU) is not run again. When it runs, it runs off the event loop."""
    key_id = key_id_of(secret)
    if key_id is None:
        return None
    async with db.session() as s:
        row = await s.get(ApiKey, key_id)
    if row is None:
        return None
    if row.secret_hash != proven and not await asyncio.to_thread(
        check_secret, secret, row.secret_hash
    ):
        return None
    revoked = row.revoked_at is not None
    priority = row.priority if row.priority in PRIORITY_BANDS else None
    terms = FlowTerms(row.weight, row.max_waiting, priority)  # type: ignore[arg-type]
    return KeyRecord(row.id, row.name, row.rpm, row.tpm, revoked, row.secret_hash, row.team, terms)


async def mark_revoked(db: Database, key_id: str) -> bool:
    async with db.session() as s, s.begin():
        res = await s.execute(
            update(ApiKey)
            .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
    return bool(res.rowcount)  # type: ignore[attr-defined]


async def all_keys(db: Database) -> list[dict[str, Any]]:
    async with db.session() as s:
        rows = (await s.execute(select(ApiKey).order_by(ApiKey.created_at))).scalars().all()
    return [
        {
            "id": r.id,
            "name": r.name,
            "prefix": f"{SECRET_PREFIX}{r.id}-",
            "rpm": r.rpm,
            "tpm": r.tpm,
            "team": r.team,
            "weight": r.weight,
            "max_waiting": r.max_waiting,
            "priority": r.priority,
            "created_at": r.created_at.isoformat(),
            "revoked_at": r.revoked_at.isoformat() if r.revoked_at else None,
        }
        for r in rows
    ]


# ---------------------------------------------------------------- one-shot (CLI, supervisor)


async def _open(settings: Settings) -> Database:
    db = Database(settings)
    await db.migrate()
    return db


async def create_key(
    settings: Settings,
    name: str,
    rpm: int | None = None,
    tpm: int | None = None,
    team: str | None = None,
    terms: FlowTerms | None = None,
) -> tuple[str, str]:
    """A new key; returns (key id, secret). The secret is never stored and never shown again.
    With ``team``, the key's requests are billed and limited as that team (and flow control
    takes the team's terms from the teams file); ``terms``: the key's own otherwise."""
    db = await _open(settings)
    try:
        return await insert_key(db, name, rpm, tpm, team, terms)
    finally:
        await db.close()


async def list_keys(settings: Settings) -> list[dict[str, Any]]:
    db = await _open(settings)
    try:
        return await all_keys(db)
    finally:
        await db.close()


async def revoke_key(settings: Settings, key_id: str) -> bool:
    """True when the key existed and was live."""
    db = await _open(settings)
    try:
        return await mark_revoked(db, key_id)
    finally:
        await db.close()


async def ensure_dev_key(settings: Settings) -> str:
    """The development key in ``<state_dir>/dev-api-key``: reused while it verifies, else a new
    key named "dev" (file mode 0600)."""
    path = Path(settings.state_dir) / DEV_KEY_FILE
    db = await _open(settings)
    try:
        if path.exists():
            secret = path.read_text().strip()
            rec = await find_key(db, secret)
            if rec is not None and not rec.revoked:
                return secret
        _, secret = await insert_key(db, DEV_KEY_NAME, None, None)
    finally:
        await db.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return secret
