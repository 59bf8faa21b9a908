"""Which KV blocks each sequence holds: prefix-cache lookups, growth, release, registration.

Used by the scheduler (``find_prefix``/``can_admit``/``admit``, ``can_grow``/``grow``,
``free``) and by the engine after each forward (``commit`` registers blocks that just became
full). Sits between :class:`~libs.engine.sequence.Sequence` and
:class:`~libs.engine.block_pool.BlockPool` so neither knows about the other.
"""

from __future__ import annotations

from libs.engine.block_pool import BlockPool
from libs.engine.hashing import ROOT_HASH, block_hash
from libs.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KvManager:
    def __init__(self, pool: BlockPool, model_id: str) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id

    # ------------------------------------------------------------------ hashing

    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to cover its first ``num_full_blocks`` full blocks."""
        bs = self.block_size
        # A LoRA adapter's blocks hash apart from the base model's and every other adapter's.
        model_id = f"{self.model_id}+{seq.lora_key}" if seq.lora_key else self.model_id
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            seq.block_hashes.append(
                block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], model_id)
            )

    # ------------------------------------------------------------------ admission

    def find_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of ``seq`` (not yet acquired). Never covers the last
        token: it must be computed to get logits, and a shared block is never written."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _blocks_to_take(self, hits: list[int], num_tokens_after: int) -> int:
        """Free blocks consumed by admitting with ``hits`` and growing to ``num_tokens_after``:
        new blocks plus cached hits that currently sit in the free queue."""
        revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        return blocks_for(num_tokens_after, self.block_size) - len(hits) + revived

    def can_admit(self, hits: list[int], num_tokens_after: int) -> bool:
        return self.pool.can_allocate(self._blocks_to_take(hits, num_tokens_after))

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Give a waiting ``seq`` its prefix hits and blocks for ``num_new_tokens`` more."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id}/{seq.index} already holds blocks")
        for b in hits:
            self.pool.acquire(b)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.grow(seq, num_new_tokens)

    # ------------------------------------------------------------------ growth

    def _new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self._new_blocks(seq, num_new_tokens))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` tokens after ``seq.num_computed_tokens``."""
        n = self._new_blocks(seq, num_new_tokens)
        if n:
            seq.block_table.extend(self.pool.allocate(n))

    def trim(self, seq: Sequence) -> None:
        """Release blocks past those ``seq.token_ids`` needs: grown for proposed tokens that
        were not kept. They were never registered (they hold no verified full block)."""
        keep = blocks_for(seq.num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finish, abort, preemption). Cached ones stay cached."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ after a forward

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are now full of computed tokens."""
        if not self.pool.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        self._ensure_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
