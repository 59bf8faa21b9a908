"""Tiny random KV exports for cache tests: real chain hashes over random token ids."""

from __future__ import annotations

import torch

from libs.engine.hashing import chain_hashes
from libs.engine.kv_transfer import KvBlocks


def random_blocks(
    model_id: str,
    num_blocks: int,
    seed: int = 0,
    *,
    layers: int = 2,
    kv_heads: int = 2,
    block_size: int = 4,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    tokens: list[int] | None = None,
) -> KvBlocks:
    """``num_blocks`` full blocks of a random prompt (or of ``tokens``) with random KV.

    Bytes per block: layers * 2 * kv_heads * block_size * head_dim * itemsize (1024 by default).
    """
    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(0, 50_000, (num_blocks * block_size,), generator=g).tolist()
    hashes = chain_hashes(tokens, block_size, model_id)[:num_blocks]
    # [layers, 2, kv_heads, num_blocks, block_size, head_dim]
    data = torch.randn(layers, 2, kv_heads, num_blocks, block_size, head_dim, generator=g)
    return KvBlocks.from_tensor(model_id, hashes, data.to(dtype))


def block_bytes(kv: KvBlocks) -> int:
    """Bytes of one block of ``kv``."""
    return kv.data.numel() * kv.data.element_size() // len(kv.header.block_hashes)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe, -0.0 != 0.0)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )
