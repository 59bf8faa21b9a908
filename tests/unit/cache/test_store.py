"""BlockStore on CPU with tiny random blocks: LRU by bytes, disk tier, miss reasons, changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine.kv_transfer import KvBlocks
from libs.settings import CacheSettings
from services.cache.store import DISK_SUFFIX, BlockKey, BlockStore
from tests.support.kv_blocks import block_bytes, random_blocks, same_bits

pytestmark = pytest.mark.unit

M = "model-a"
BLOCK = block_bytes(random_blocks(M, 1))  # 1024 bytes


def store(memory_blocks: int, disk_blocks: int = 0, disk_dir: Path | None = None) -> BlockStore:
    return BlockStore(
        CacheSettings(
            memory_bytes=memory_blocks * BLOCK,
            disk_dir=str(disk_dir) if disk_dir else "",
            disk_bytes=disk_blocks * BLOCK,
        )
    )


def keys(kv: KvBlocks, salt: str = "") -> list[BlockKey]:
    return [BlockKey(kv.header.model_id, salt, h) for h in kv.header.block_hashes]


def test_put_then_get_returns_the_same_bits_and_the_leading_hits_only() -> None:
    s = store(memory_blocks=8)
    kv = random_blocks(M, 3, seed=1)
    changes = s.put(kv)
    assert changes.stored == keys(kv) and not changes.evicted
    asked = [*kv.header.block_hashes, 12345]  # one block more than held
    got, outcome, _ = s.get(M, asked)
    assert got is not None and same_bits(got.data, kv.data)
    assert got.header.block_hashes == kv.header.block_hashes
    assert (outcome.num_hit_blocks, outcome.miss_reason) == (3, "not_stored")


def test_memory_is_bounded_by_bytes_and_evicts_chain_tails_before_roots() -> None:
    s = store(memory_blocks=4)
    a, b = random_blocks(M, 3, seed=1), random_blocks(M, 3, seed=2)
    s.put(a)
    changes = s.put(b)
    assert s.memory_bytes == 4 * BLOCK and s.memory_blocks == 4
    # The oldest blocks go first, and within one put the tail goes before the root.
    assert changes.evicted == [keys(a)[2], keys(a)[1]]
    out = s.lookup(M, a.header.block_hashes)
    assert (out.num_hit_blocks, out.miss_reason) == (1, "evicted")
    assert s.lookup(M, b.header.block_hashes).num_hit_blocks == 3


def test_fetch_makes_blocks_recent_so_others_are_evicted_first() -> None:
    s = store(memory_blocks=4)
    a, b, c = (random_blocks(M, 2, seed=i) for i in (1, 2, 3))
    s.put(a)
    s.put(b)
    s.get(M, a.header.block_hashes)  # a is now more recent than b
    changes = s.put(c)
    assert set(changes.evicted) == set(keys(b))
    assert s.lookup(M, a.header.block_hashes).num_hit_blocks == 2


def test_storing_held_blocks_again_changes_nothing() -> None:
    s = store(memory_blocks=8)
    kv = random_blocks(M, 3, seed=1)
    s.put(kv)
    again = s.put(kv)
    assert not again and s.memory_blocks == 3 and s.stats.stored_blocks == 3


def test_every_miss_has_its_reason() -> None:
    s = store(memory_blocks=2)
    tokens = list(range(8))
    kv = random_blocks(M, 2, seed=1, tokens=tokens)
    s.put(kv, salt="tenant-1")
    hashes = kv.header.block_hashes

    def reason(model: str, hs: list[int], salt: str = "") -> str | None:
        return s.lookup(model, hs, salt).miss_reason

    assert reason(M, [], "tenant-1") == "shorter_than_one_block"
    assert reason(M, hashes, "tenant-1") is None
    assert reason(M, hashes, "tenant-2") == "salt"
    assert reason("model-b", hashes, "tenant-1") == "other_model"
    assert reason(M, random_blocks(M, 1, seed=9).header.block_hashes) == "not_stored"
    s.put(random_blocks(M, 2, seed=2))  # evicts both of kv's blocks
    assert reason(M, hashes, "tenant-1") == "evicted"
    st = s.stats
    assert st.misses == {
        ("lookup", r): 1
        for r in ("shorter_than_one_block", "salt", "other_model", "not_stored", "evicted")
    }
    assert (st.hits["lookup"], st.queries["lookup"]) == (2, 9)  # blocks


def test_the_evicted_history_is_bounded() -> None:
    s = BlockStore(CacheSettings(memory_bytes=BLOCK, evicted_history=1))
    first, second, third = (random_blocks(M, 1, seed=i) for i in (1, 2, 3))
    s.put(first)
    s.put(second)  # evicts first
    s.put(third)  # evicts second; history holds only the latest eviction
    assert s.lookup(M, second.header.block_hashes).miss_reason == "evicted"
    assert s.lookup(M, first.header.block_hashes).miss_reason == "not_stored"


def test_a_block_larger_than_the_memory_budget_is_refused() -> None:
    s = BlockStore(CacheSettings(memory_bytes=BLOCK - 1))
    assert not s.put(random_blocks(M, 2, seed=1))
    assert s.memory_blocks == 0 and s.stats.refused_blocks == 2


def test_memory_evictions_spill_to_disk_and_come_back_bit_for_bit(tmp_path: Path) -> None:
    s = store(memory_blocks=2, disk_blocks=4, disk_dir=tmp_path)
    kv = random_blocks(M, 5, seed=1)
    changes = s.put(kv)
    assert not changes.evicted, "spilled blocks are still held"
    assert (s.memory_blocks, s.disk_blocks) == (2, 3)
    assert [s.tier(k) for k in keys(kv)] == ["memory", "memory", "disk", "disk", "disk"]
    assert len(list(tmp_path.glob(f"*{DISK_SUFFIX}"))) == 3
    assert s.lookup(M, kv.header.block_hashes).num_hit_blocks == 5
    got, outcome, _ = s.get(M, kv.header.block_hashes)
    assert got is not None and outcome.num_hit_blocks == 5 and same_bits(got.data, kv.data)
    # The fetch brought the chain's root blocks back to memory; the rest spilled again.
    assert [s.tier(k) for k in keys(kv)][:2] == ["memory", "memory"]
    assert s.memory_bytes <= 2 * BLOCK and s.disk_bytes <= 4 * BLOCK


def test_the_disk_tier_is_bounded_and_its_evictions_are_final(tmp_path: Path) -> None:
    s = store(memory_blocks=1, disk_blocks=2, disk_dir=tmp_path)
    kv = random_blocks(M, 5, seed=1)
    changes = s.put(kv)
    assert changes.evicted == [keys(kv)[4], keys(kv)[3]]
    assert (s.memory_blocks, s.disk_blocks) == (1, 2)
    assert len(list(tmp_path.glob(f"*{DISK_SUFFIX}"))) == 2
    assert s.stats.evictions["memory"] == 4 and s.stats.evictions["disk"] == 2
    assert s.lookup(M, kv.header.block_hashes).miss_reason == "evicted"


def test_bfloat16_blocks_survive_the_disk_tier(tmp_path: Path) -> None:
    s = store(memory_blocks=0, disk_blocks=0, disk_dir=tmp_path)
    s.memory_budget, s.disk_budget = BLOCK // 2, 8 * BLOCK  # bf16 blocks are half the bytes
    kv = random_blocks(M, 3, seed=4, dtype=torch.bfloat16)
    s.put(kv)
    assert s.disk_blocks == 2
    got, _, _ = s.get(M, kv.header.block_hashes)
    assert got is not None and got.header.dtype == "bfloat16" and same_bits(got.data, kv.data)


def test_a_block_lost_from_disk_is_an_eviction_not_a_crash(tmp_path: Path) -> None:
    s = store(memory_blocks=1, disk_blocks=4, disk_dir=tmp_path)
    kv = random_blocks(M, 3, seed=1)
    s.put(kv)
    for f in tmp_path.glob(f"*{DISK_SUFFIX}"):
        f.unlink()
    got, outcome, changes = s.get(M, kv.header.block_hashes)
    assert got is not None and got.header.block_hashes == kv.header.block_hashes[:1]
    assert (outcome.num_hit_blocks, outcome.miss_reason) == (1, "evicted")
    assert keys(kv)[1] in changes.evicted


def test_a_new_store_starts_with_an_empty_disk_tier(tmp_path: Path) -> None:
    (tmp_path / f"stale{DISK_SUFFIX}").write_bytes(b"x")
    (tmp_path / "not-ours.txt").write_bytes(b"keep")
    s = store(memory_blocks=1, disk_blocks=4, disk_dir=tmp_path)
    assert s.disk_blocks == 0
    assert [p.name for p in tmp_path.iterdir()] == ["not-ours.txt"]
