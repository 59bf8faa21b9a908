"""API-key authentication for the gateway.

``KeyStore.verify`` is called once per request by the ``require_key`` dependency in ``deps.py``
with the bearer token; it returns the key's identity and limits, or None. Keys are stored only as
salted hashes (see ``libs.db`` for the database-backed store).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from libs.db.keys import FlowTerms


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    name: str
    rpm: int | None = None  # requests per minute; None: the gateway default
    tpm: int | None = None  # tokens per minute; None: the gateway default
    team: str | None = None  # the team (docs/security.md) the key bills as
    terms: FlowTerms = field(
        default_factory=FlowTerms
    )  # flow control's weight, waiting bound, best band


class KeyStore(Protocol):
    async def verify(self, secret: str) -> KeyInfo | None: ...


class OpenKeyStore:
    """Used when ``gateway.auth_enabled`` is false: every caller is the anonymous key."""

    ANONYMOUS = KeyInfo(key_id="anonymous", name="anonymous")

    async def verify(self, secret: str) -> KeyInfo | None:
        return self.ANONYMOUS
