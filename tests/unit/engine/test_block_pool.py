from __future__ import annotations

import pytest

from libs.engine.block_pool import BlockPool

pytestmark = pytest.mark.unit


def test_allocate_release_and_refcounts() -> None:
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count[b] == 1 for b in a)
    pool.acquire(a[0])  # shared by a second sequence
    pool.release(a)
    assert pool.ref_count[a[0]] == 1 and pool.num_free == 3
    with pytest.raises(MemoryError):
        pool.allocate(4)
    pool.release([a[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release([a[0]])


def test_freed_cached_blocks_stay_reusable_until_evicted_lru() -> None:
    pool = BlockPool(3, 16)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, (101, 102, 103), strict=True):
        assert pool.register(b, h)
    assert pool.drain_events() == ([101, 102, 103], [])
    pool.release(blocks)  # tail first: 103 is least recently used, then 102, then 101
    assert pool.num_free == 3 and pool.num_cached == 3
    # A prefix hit revives a free cached block without eviction.
    assert pool.lookup(101) == blocks[0]
    pool.acquire(blocks[0])
    assert pool.num_free == 2
    # Allocation evicts the least recently freed cached block first.
    (got,) = pool.allocate(1)
    assert got == blocks[2]
    assert pool.lookup(103) is None and pool.lookup(102) == blocks[1]
    assert pool.drain_events() == ([], [103])


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(2, 16)
    cached, plain = pool.allocate(2)
    pool.register(cached, 7)
    pool.release([cached, plain])
    assert pool.allocate(1) == [plain]
    assert pool.lookup(7) == cached


def test_duplicate_hash_and_disabled_cache_register_nothing() -> None:
    pool = BlockPool(2, 16)
    a, b = pool.allocate(2)
    assert pool.register(a, 5)
    assert not pool.register(b, 5)  # another block already holds this content
    off = BlockPool(1, 16, enable_prefix_caching=False)
    (c,) = off.allocate(1)
    assert not off.register(c, 5) and off.lookup(5) is None
