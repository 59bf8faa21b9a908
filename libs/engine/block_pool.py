"""The KV block pool: ref-counted fixed-size blocks plus the automatic prefix cache.

Owned by the engine's :class:`~libs.engine.kv_manager.KvManager`, used only on the engine thread.
A block holds the K/V of ``block_size`` consecutive tokens of one sequence, in every layer (the
tensors live in :class:`~libs.engine.model_runner.KvCache`; this class only does bookkeeping).

Invariants:

- ``ref_count[b]`` is the number of running sequences whose block table holds ``b``.
- A block with ``ref_count == 0`` is in ``free_queue`` (ordered least recently freed first);
  if it also has a hash it is a *cached* block: reusable by a prefix hit until it is allocated
  for something else, at which point its hash is evicted.
- ``hash_to_block`` maps a chain hash to the one block registered under it.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Bookkeeping of ``num_blocks`` KV blocks; see the module docstring for invariants."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks; raise engine.kv_cache_bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks, least recently freed first (the LRU end is popped first). Values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Chain hashes stored into / evicted from the cache since the last drain_events().
        self._stored: list[int] = []
        self._evicted: list[int] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self.hash_to_block)

    def lookup(self, chain_hash: int) -> int | None:
        """The block registered under ``chain_hash``, or None."""
        if not self.enable_prefix_caching:
            return None
        return self.hash_to_block.get(chain_hash)

    # ------------------------------------------------------------------ actions

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each), evicting cached ones LRU first."""
        if n > len(self.free_queue):
            raise MemoryError(f"need {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def acquire(self, block: int) -> None:
        """Add a reference to ``block`` (a prefix hit or a fork); revives a free cached block."""
        if self.ref_count[block] == 0:
            del self.free_queue[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Blocks reaching zero become free; they are queued
        last-block-first so a sequence's tail is evicted before its (more shareable) head."""
        for block in reversed(blocks):
            rc = self.ref_count[block] - 1
            if rc < 0:
                raise RuntimeError(f"KV block {block} released more times than acquired")
            self.ref_count[block] = rc
            if rc == 0:
                if self.block_hash[block] is None:
                    # Uncached blocks are reused first: put them at the LRU end.
                    self.free_queue[block] = None
                    self.free_queue.move_to_end(block, last=False)
                else:
                    self.free_queue[block] = None

    def register(self, block: int, chain_hash: int) -> bool:
        """Record that ``block`` holds the full block hashed ``chain_hash``. Returns False (and
        registers nothing) when caching is off or another block already holds that hash."""
        if not self.enable_prefix_caching or chain_hash in self.hash_to_block:
            return False
        if self.block_hash[block] is not None:
            raise RuntimeError(f"KV block {block} is already registered")
        self.block_hash[block] = chain_hash
        self.hash_to_block[chain_hash] = block
        self._stored.append(chain_hash)
        return True

    def reset_cache(self) -> None:
        """Forget every cached hash of free blocks (e.g. after loading other weights)."""
        for block in list(self.free_queue):
            self._evict(block)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted) chain hashes since the last call; for the worker's KV events."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            del self.hash_to_block[h]
            self._evicted.append(h)
