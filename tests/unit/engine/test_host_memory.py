"""Huge-page host tensors (libs/engine/host_memory.py) and their users."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from libs.engine import host_memory
from libs.engine.attention import KvCache

pytestmark = pytest.mark.unit

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory advice")


def thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding ``address`` with huge pages."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_is_a_zeroed_contiguous_tensor_that_outlives_its_mapping() -> None:
    t = host_memory.zeros((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    view = t[1]
    del t
    gc.collect()
    view.fill_(2.0)  # the mapping is still there
    assert view.sum().item() == 70.0


@linux
def test_zeros_starts_on_a_huge_page_advised_for_huge_pages() -> None:
    t = host_memory.zeros((4 * 2**20,), torch.float32)  # 16 MiB
    assert t.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert thp_eligible(t.data_ptr()) == ("[never]" not in mode), mode


@linux
def test_the_cpu_kv_cache_lives_on_huge_pages() -> None:
    cache = KvCache(2, 64, 16, 2, 64, torch.float32, torch.device("cpu"))
    assert cache.data.shape == (2, 2, 2, 64, 16, 64)
    assert cache.data.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert torch.count_nonzero(cache.data) == 0


@linux
@pytest.mark.parametrize("blocks", [64, 65])
def test_the_kv_cache_never_starts_at_offset_0_or_1_of_its_storage(blocks: int) -> None:
    """A compiled graph's guards read ``2 <= storage_offset`` of the cache (dynamo specialises
    0 and 1). 64 blocks of 32 KiB are 2 MiB: the kernel aligns such a mapping, which put the
    cache at offset 0 at some starts of a worker and made its saved graphs not fit."""
    for _ in range(4):
        cache = KvCache(2, blocks, 16, 2, 64, torch.float32, torch.device("cpu"))
        assert cache.data.storage_offset() >= 2
        assert cache.data.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
