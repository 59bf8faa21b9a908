"""Exact-match response cache for deterministic requests.

A request is deterministic when it asks for greedy sampling (``temperature`` 0) or fixes a
``seed``. Its key is a SHA-256 over the API key id, the route kind and the canonical JSON of
the body without the stream flags, so a streamed and a plain request share an entry. Entries
are whole non-streaming response bodies; bounded by ``gateway.response_cache_entries`` and
``gateway.response_cache_bytes`` (least recently used goes first), each living
``gateway.response_cache_ttl_s``. Scoped per API key so one tenant cannot probe another's
prompts through hit timing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel

from libs.settings import GatewaySettings

STREAM_FIELDS = frozenset({"stream", "stream_options"})


def is_deterministic(body: BaseModel) -> bool:
    """Greedy or seeded, and not a tool-calling request (its calls get fresh ids each time)."""
    if getattr(body, "tools", None):
        return False
    return getattr(body, "temperature", None) == 0 or getattr(body, "seed", None) is not None


def cache_key(key_id: str, kind: str, body: BaseModel) -> str:
    canon = body.model_dump(mode="json", exclude=set(STREAM_FIELDS))
    blob = json.dumps([key_id, kind, canon], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class ResponseCache:
    def __init__(self, settings: GatewaySettings) -> None:
        self.enabled = settings.response_cache_enabled
        self.max_entries = settings.response_cache_entries
        self.max_bytes = settings.response_cache_bytes
        self.ttl_s = settings.response_cache_ttl_s
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> dict[str, Any] | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        blob, expires = hit
        if expires <= time.monotonic():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        body: dict[str, Any] = json.loads(blob)
        return body

    def put(self, key: str, body: dict[str, Any]) -> None:
        blob = json.dumps(body, separators=(",", ":")).encode()
        if len(blob) > self.max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (blob, time.monotonic() + self.ttl_s)
        self.bytes += len(blob)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        blob, _ = self._entries.pop(key)
        self.bytes -= len(blob)
