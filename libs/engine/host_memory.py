"""Host tensors on transparent huge pages, for the memory the engine streams every step.

Called by :class:`~libs.engine.attention.KvCache` (the KV cache on a CPU device) and by
:func:`~libs.engine.kernels.linear.pack_linears` (the packed weights). Both are read in full,
block by block or panel by panel, every step: on 4 KiB pages each step walks ~130,000 page
translations for SmolLM2's weights alone. 2 MiB pages cut that ~500-fold; measured here, the
one-row linear reads ~6% faster and paged attention ~10% (docs/decisions/0008-huge-pages.md).

Where the kernel does not offer transparent huge pages (``MADV_HUGEPAGE`` missing, or THP set
to ``never``), the tensor is an ordinary zeroed allocation on small pages: same contents,
same behaviour.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 * 2**20  # x86-64 and arm64 transparent huge page size


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor whose storage starts on a 2 MiB boundary and is
    advised for huge pages (Linux); ``torch.zeros`` elsewhere. The tensor keeps its mapping
    alive; the memory is returned when the last view of it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Anonymous private memory is zero-filled by the kernel and not touched until first use,
    # so the advice comes before any page is backed. One extra huge page leaves room to align.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(advice)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf`
    # NOTE: never at offset 0 of its storage. A compiled graph takes the KV cache's storage
    # offset as a symbolic size, which dynamo specialises at 0 and 1 (a saved graph's guard
    # reads `2 <= offset`): the kernel aligns a mapping whose length is a multiple of 2 MiB
    # (a block count that is a multiple of 128 for SmolLM2), so an offset of 0 would turn up
    # at some starts and not others, and a saved graph would not fit them. The extra huge
    # page leaves room for a whole page's offset.
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES or HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(shape)


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one dtype) packed back to back in one arena from :func:`zeros`,
    in order: weights one step streams, read from huge pages. Called once at load by
    ``pack_linears`` and ``quant.quantize_model``."""
    if not tensors:
        return []
    arena = zeros((sum(t.numel() for t in tensors),), tensors[0].dtype)
    out, offset = [], 0
    for t in tensors:
        view = arena[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += t.numel()
    return out
