"""Prefix-cache chain hashes: stable across processes and machines.

A full block's hash is ``blake2b(parent hash ‖ model id ‖ the block's token ids)``, 8 bytes read
as a signed little-endian int64 (so it fits JSON, SQL BIGINT and msgspec ints). The first block's
parent is :data:`ROOT_HASH`. Equal hashes mean equal token prefixes of the same model, which is
what lets the router, the cache service and every worker talk about the same blocks. Never use
Python's ``hash()`` here: it is salted per process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0  # parent of a sequence's first block
HASH_BYTES = 8  # digest size: int64


def block_hash(parent: int, token_ids: Sequence[int], model_id: str) -> int:
    """Chain hash of one full block of ``token_ids`` that follows the block hashed ``parent``."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent.to_bytes(HASH_BYTES, "little", signed=True))
    h.update(model_id.encode())
    # Token ids as little-endian uint32 (byte order fixed for cross-machine stability).
    ids = array("I", token_ids)
    if ids.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes on this platform")
    h.update(ids.tobytes() if _LITTLE else _byteswapped(ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def chain_hashes(
    token_ids: Sequence[int], block_size: int, model_id: str, parent: int = ROOT_HASH
) -> list[int]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], model_id)
        out.append(parent)
    return out


_LITTLE = array("I", [1]).tobytes()[0] == 1


def _byteswapped(ids: array) -> bytes:  # pragma: no cover - big-endian hosts only
    swapped = array("I", ids)
    swapped.byteswap()
    return swapped.tobytes()
