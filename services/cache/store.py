"""The prefix cache's block store: a memory LRU bounded by bytes, an optional disk tier, and
the reason for every miss.

A block is keyed by :class:`BlockKey` ``(model_id, salt, chain hash)``; the chain hash
(libs/engine/hashing.py) already covers the parent block, the token ids and the model id, so
equal keys mean equal prefixes. Blocks live in exactly one tier at a time::

    put ──► memory (LRU, cache.memory_bytes) ──evict──► disk (LRU, cache.disk_bytes) ──evict──► gone
                 ▲                                         │
                 └────────── reload on fetch ──────────────┘

Without a disk tier, memory evictions are gone at once. "Evicted" (in events and miss reasons)
means gone from every tier. Nothing here touches NATS or Prometheus: operations return what
changed (:class:`Changes`) and the service publishes it; counters are in :attr:`BlockStore.stats`.
The store is not thread-safe; the service calls it from its one event loop.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from libs.engine.kv_transfer import KvBlocks
from libs.log import fields
from libs.protocol import CacheMissReason
from libs.settings import CacheSettings

log = logging.getLogger("strait.cache.store")

DISK_SUFFIX = ".kvblock"  # files of the disk tier; only these are ever deleted from disk_dir

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class BlockKey:
    model_id: str
    salt: str
    block_hash: int  # chain hash, signed int64


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one block's tensor is; equal for every block of one model's full-layer exports."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    layer_start: int
    shape: tuple[int, ...]  # [layers, 2 (k, v), kv_heads, block_size, head_dim]


@dataclass(slots=True)
class _OnDisk:
    layout: BlockLayout
    nbytes: int
    path: Path


@dataclass
class Changes:
    """Keys that started (``stored``) or stopped (``evicted``: left every tier) being held."""

    stored: list[BlockKey] = field(default_factory=list)
    evicted: list[BlockKey] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted)


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    num_hit_blocks: int
    miss_reason: CacheMissReason | None  # None: every block asked about is held


@dataclass
class StoreStats:
    """Counters since start, by op ("lookup" / "fetch")."""

    queries: Counter[str] = field(default_factory=Counter)  # blocks asked about
    hits: Counter[str] = field(default_factory=Counter)  # blocks asked about and held
    # Requests whose chain broke, by (op, reason of the first missing block): a chain breaks
    # once, every later block of it misses for the same reason (queries - hits of them).
    misses: Counter[tuple[str, str]] = field(default_factory=Counter)
    stored_blocks: int = 0
    # Blocks that left a tier: "memory" (spilled to disk or gone), "disk" (gone).
    evictions: Counter[str] = field(default_factory=Counter)
    refused_blocks: int = 0  # a single block larger than the memory budget


class BlockStore:
    def __init__(self, settings: CacheSettings) -> None:
        self.memory_budget = settings.memory_bytes
        self.disk_budget = settings.disk_bytes if settings.disk_dir else 0
        self.disk_dir = Path(settings.disk_dir) if settings.disk_dir else None
        self.evicted_history = settings.evicted_history
        # NOTE: OrderedDicts in LRU order: first = least recently used = next to evict.
        self._memory: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()
        self._disk: OrderedDict[BlockKey, _OnDisk] = OrderedDict()
        self.memory_bytes = 0
        self.disk_bytes = 0
        # chain hash -> (model_id, salt) of every held key with it: tells "salt" and
        # "other_model" misses from "not_stored" ones.
        self._holders: dict[int, set[tuple[str, str]]] = {}
        # Keys evicted from every tier, most recent last, at most evicted_history of them.
        self._evicted: OrderedDict[BlockKey, None] = OrderedDict()
        # Layout of every held key (either tier), so the memory tier holds bare tensors.
        self._layouts: dict[BlockKey, BlockLayout] = {}
        self.stats = StoreStats()
        if self.disk_dir is not None:
            self._reset_disk(self.disk_dir)

    # ------------------------------------------------------------ queries

    @property
    def memory_blocks(self) -> int:
        return len(self._memory)

    @property
    def disk_blocks(self) -> int:
        return len(self._disk)

    def tier(self, key: BlockKey) -> str | None:
        """ "memory", "disk", or None when not held."""
        if key in self._memory:
            return "memory"
        if key in self._disk:
            return "disk"
        return None

    def lookup(
        self, model_id: str, block_hashes: list[int], salt: str = "", op: str = "lookup"
    ) -> LookupOutcome:
        """Leading held blocks of this prefix, and why the first one that is not held misses.
        Counts the blocks asked about under ``op``; does not change recency."""
        hit = 0
        for h in block_hashes:
            if self.tier(BlockKey(model_id, salt, h)) is None:
                break
            hit += 1
        reason: CacheMissReason | None = None
        if not block_hashes:
            reason = "shorter_than_one_block"
        elif hit < len(block_hashes):
            reason = self._miss_reason(BlockKey(model_id, salt, block_hashes[hit]))
        self.stats.queries[op] += len(block_hashes)
        self.stats.hits[op] += hit
        if reason is not None:
            self.stats.misses[(op, reason)] += 1
        return LookupOutcome(hit, reason)

    def _miss_reason(self, key: BlockKey) -> CacheMissReason:
        if key in self._evicted:
            return "evicted"
        holders = self._holders.get(key.block_hash, set())
        if any(model == key.model_id for model, _ in holders):
            return "salt"
        if holders:
            return "other_model"
        return "not_stored"

    # ------------------------------------------------------------ put / get

    def put(self, kv: KvBlocks, salt: str = "") -> Changes:
        """Hold every block of ``kv`` (already-held ones only become recent); evict to budget."""
        h = kv.header
        # kv.data: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
        layers, two, heads, num_blocks, block_size, head_dim = kv.data.shape
        layout = BlockLayout(h.dtype, h.layer_start, (layers, two, heads, block_size, head_dim))
        changes = Changes()
        # NOTE: newest-last LRU, so walk the chain from its tail to its root: the root (which
        # every longer prefix needs) ends up most recent and is evicted last.
        for i in reversed(range(num_blocks)):
            key = BlockKey(h.model_id, salt, h.block_hashes[i])
            if key in self._memory:
                self._memory.move_to_end(key)
                continue
            if key in self._disk:
                self._disk.move_to_end(key)
                continue
            # Own storage (clone), so one held block never pins a whole export's tensor.
            block = kv.data[:, :, :, i].clone(memory_format=torch.contiguous_format)
            nbytes = _nbytes(block)
            if nbytes > self.memory_budget:
                self.stats.refused_blocks += 1
                continue
            self._memory[key] = block
            self.memory_bytes += nbytes
            self._holders.setdefault(key.block_hash, set()).add((key.model_id, key.salt))
            self._evicted.pop(key, None)
            self._layouts[key] = layout
            changes.stored.append(key)
            self.stats.stored_blocks += 1
        changes.stored.reverse()  # prefix order
        self._evict_memory(changes)
        return changes

    def get(
        self, model_id: str, block_hashes: list[int], salt: str = ""
    ) -> tuple[KvBlocks | None, LookupOutcome, Changes]:
        """The leading held blocks as one KvBlocks (None when the first misses). Blocks read
        from disk move back to memory; every returned block becomes recent."""
        outcome = self.lookup(model_id, block_hashes, salt, op="fetch")
        changes = Changes()
        blocks: list[torch.Tensor] = []
        first: BlockLayout | None = None
        cut: CacheMissReason | None = None  # why a held block could not be returned
        for h in block_hashes[: outcome.num_hit_blocks]:
            key = BlockKey(model_id, salt, h)
            layout = self._layouts[key]
            if first is None:
                first = layout
            elif layout != first:
                # Blocks of one prefix exported with another layout (layer range, dtype)
                # cannot be stacked: the fetch ends before them.
                cut = "not_stored"
                break
            block = self._memory.get(key)
            if block is None:
                block = self._read_disk(key, changes)
                if block is None:
                    cut = "evicted"
                    break
            blocks.append(block)
        if cut is not None:
            outcome = LookupOutcome(len(blocks), cut)
        if not blocks or first is None:
            return None, outcome, changes
        # Promote in reverse for the same reason as put: the chain's root ends most recent.
        for i in reversed(range(len(blocks))):
            self._promote(BlockKey(model_id, salt, block_hashes[i]), blocks[i])
        self._evict_memory(changes)
        # [layers, 2, kv_heads, num_blocks, block_size, head_dim]
        data = torch.stack(blocks, dim=3)
        kv = KvBlocks.from_tensor(model_id, block_hashes[: len(blocks)], data, first.layer_start)
        return kv, outcome, changes

    def _promote(self, key: BlockKey, block: torch.Tensor) -> None:
        if key in self._memory:
            self._memory.move_to_end(key)
            return
        spilled = self._disk.pop(key)
        self.disk_bytes -= spilled.nbytes
        spilled.path.unlink(missing_ok=True)
        self._memory[key] = block
        self.memory_bytes += spilled.nbytes

    # ------------------------------------------------------------ eviction

    def _evict_memory(self, changes: Changes) -> None:
        while self.memory_bytes > self.memory_budget and self._memory:
            key, block = self._memory.popitem(last=False)
            nbytes = _nbytes(block)
            self.memory_bytes -= nbytes
            self.stats.evictions["memory"] += 1
            if not self._spill(key, block, nbytes):
                self._forget(key, changes)
        self._evict_disk(changes)

    def _spill(self, key: BlockKey, block: torch.Tensor, nbytes: int) -> bool:
        """Write an evicted memory block to the disk tier; False when it cannot go there."""
        if self.disk_dir is None or nbytes > self.disk_budget:
            return False
        path = self.disk_dir / f"{_file_stem(key)}{DISK_SUFFIX}"
        try:
            path.write_bytes(block.view(torch.uint8).numpy().tobytes())
        except OSError as e:
            log.warning("disk tier write failed", extra=fields(path=str(path), error=repr(e)))
            return False
        self._disk[key] = _OnDisk(self._layouts[key], nbytes, path)
        self.disk_bytes += nbytes
        return True

    def _evict_disk(self, changes: Changes) -> None:
        while self.disk_bytes > self.disk_budget and self._disk:
            key, spilled = self._disk.popitem(last=False)
            self.disk_bytes -= spilled.nbytes
            spilled.path.unlink(missing_ok=True)
            self.stats.evictions["disk"] += 1
            self._forget(key, changes)

    def _read_disk(self, key: BlockKey, changes: Changes) -> torch.Tensor | None:
        spilled = self._disk[key]
        try:
            raw = spilled.path.read_bytes()
        except OSError as e:
            log.warning(
                "disk tier read failed", extra=fields(path=str(spilled.path), error=repr(e))
            )
            raw = b""
        if len(raw) != spilled.nbytes:
            # Lost or truncated on disk: the block is gone.
            del self._disk[key]
            self.disk_bytes -= spilled.nbytes
            self._forget(key, changes)
            return None
        dtype = _DTYPES[spilled.layout.dtype]
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            .view(dtype)
            .reshape(spilled.layout.shape)
        )

    def _forget(self, key: BlockKey, changes: Changes) -> None:
        """``key`` left every tier."""
        self._layouts.pop(key, None)
        holders = self._holders.get(key.block_hash)
        if holders is not None:
            holders.discard((key.model_id, key.salt))
            if not holders:
                del self._holders[key.block_hash]
        self._evicted[key] = None
        while len(self._evicted) > self.evicted_history:
            self._evicted.popitem(last=False)
        changes.evicted.append(key)

    def _reset_disk(self, disk_dir: Path) -> None:
        """The disk tier starts empty: delete this store's files left by an earlier run."""
        disk_dir.mkdir(parents=True, exist_ok=True)
        for old in disk_dir.glob(f"*{DISK_SUFFIX}"):
            old.unlink(missing_ok=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _file_stem(key: BlockKey) -> str:
    """A file name for ``key``: stable, filesystem-safe whatever the model id or salt."""
    h = hashlib.blake2b(digest_size=16)
    for part in (key.model_id, key.salt, str(key.block_hash)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
