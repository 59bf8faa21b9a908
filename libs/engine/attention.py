"""Strait's paged attention, plugged into transformers' attention-function registry.

The model runner registers :func:`paged_attention` under :data:`ATTENTION_NAME` and passes one
:class:`AttentionMetadata` per forward as the ``strait_attn`` keyword, which transformers hands
to every attention layer. Per layer the function

1. writes the step's new K/V (RoPE already applied) into their slots of the paged cache, then
2. attends each sequence's queries over that sequence's blocks.

With Strait's CPU kernels both are one ``paged_attention`` call per layer (the op
``engine.compile`` keeps opaque): every token is one query row over its sequence's block table,
seeing keys ``0..p`` for its position ``p``, so decode tokens and prefill chunks (causal,
aligned to the bottom right) are the same case. With torch's kernels:

- decode tokens (one query each) are one batched SDPA over a padded gather of their blocks,
- prefill chunks one SDPA each, with a causal mask aligned to the bottom right
  (query ``i`` of a chunk starting at position ``s`` sees keys ``0..s+i``).

GQA without copying K/V: query head ``h`` uses KV head ``h // G`` (``G`` = groups), so the
``G`` query heads of a KV head are folded into the query-length axis: ``[Hkv, G*n, D]`` against
``[Hkv, L, D]``. Cache layout per layer is ``[Hkv, num_blocks, block_size, D]``, so gathering
whole blocks with ``index_select`` yields contiguous ``[Hkv, L, D]`` keys for SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from libs.engine import host_memory

ATTENTION_NAME = "strait_paged"


class KvCache:
    """The K/V tensors of every layer; bookkeeping is the BlockPool's."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [layers, 2 (k, v), kv_heads, num_blocks, block_size, head_dim]. Zeroed, not empty:
        # padded decode reads unused slots under a mask, and 0 * NaN would poison the output.
        # On a CPU, on huge pages: attention reads scattered 4 KiB blocks every step.
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        if device.type == "cpu":
            self.data = host_memory.zeros(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return num_layers * 2 * num_kv_heads * block_size * head_dim * dtype.itemsize

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of layer ``i``, each ``[kv_heads, num_blocks, block_size, head_dim]``."""
        return self.data[i, 0], self.data[i, 1]


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's run of ``q_len`` (> 1) query tokens in the packed batch."""

    q_start: int  # first packed position
    q_len: int
    ctx_len: int  # keys attended: tokens already cached + this chunk
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long
    # [G * q_len, ctx_len] bool, True = attend; row g*q_len + i is query i of group member g.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one forward; built by the model runner."""

    cache: KvCache
    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) per token
    prefills: list[PrefillSegment] = field(default_factory=list)
    # With torch's kernels: the decode batch (one query token per sequence), B sequences
    # padded to max_blocks blocks.
    decode_token_idx: torch.Tensor | None = None  # [B] long: packed positions
    decode_block_ids: torch.Tensor | None = None  # [B * max_blocks] long
    decode_mask: torch.Tensor | None = None  # [1, B, 1, max_blocks * block_size] bool
    # Every packed token is a decode token, in order (the decode graphs' steps): the queries
    # need no gather and the outputs no scatter (two kernels a layer fewer).
    decode_all: bool = False
    # With Triton's paged kernel (CUDA, engine.cuda_attention): every token is one query row
    # over its sequence's blocks, seeing keys 0..p at position p, so decode tokens and prefill
    # chunks are the same case (as with the CPU kernels); no prefill segments, no masks.
    row_tables: torch.Tensor | None = None  # [T, max_blocks] long: the token's sequence's
    row_lens: torch.Tensor | None = None  # [T] long: position + 1 (keys the row sees)
    # With Strait's CPU kernels (libs/engine/kernels): every token is one query row.
    kernels: Any = None  # the compiled module, or None for torch's kernels
    block_tables: torch.Tensor | None = None  # [T, max_blocks] long: the token's sequence's
    context_lens: torch.Tensor | None = None  # [T] long: position + 1 (keys the row sees)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    strait_attn: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function; returns ``([1, T, H, D], None)``. Picks one of the
    paths below by what the metadata carries (each a plain call: no allocation here)."""
    meta = strait_attn
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs strait_attn metadata")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer: int = module.layer_idx  # type: ignore[assignment]
    if meta.kernels is not None:
        return _kernel_attention(query, key, value, meta, layer, scale), None
    if meta.row_lens is not None:
        return _triton_attention(query, key, value, meta, layer, scale), None
    if torch.compiler.is_compiling() and not meta.prefills:
        return _compiled_decode(query, key, value, meta, layer, scale), None
    return _torch_attention(query, key, value, meta, layer, scaling), None


def _kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """Strait's CPU kernels (``meta.kernels``): the cache write and every token's row in one
    op; ``paged_attention`` calls it for each layer. Returns ``[1, T, H, D]``."""
    # [1, H, T, D] -> [T, H, D]; key, value [1, Hkv, T, D] -> [T, Hkv, D]
    args = (
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta.cache.data,
        layer,
        meta.slot_mapping,
        meta.block_tables,
        meta.context_lens,
        scale,
    )
    if torch.compiler.is_compiling():
        out = torch.ops.strait.paged_attention(*args)
    else:
        out = meta.kernels.paged_attention(*args)
    return out.unsqueeze(0)


def _triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """Triton's paged kernel, every token a row (``meta.row_lens``; libs/engine/
    triton_attention.py); ``paged_attention`` calls it for each layer."""
    assert meta.row_tables is not None
    args = (
        query[0],
        key[0],
        value[0],
        meta.cache.data,
        layer,
        meta.slot_mapping,
        meta.row_tables,
        meta.row_lens,
        scale,
    )
    if torch.compiler.is_compiling():  # one opaque op, as in _compiled_decode
        return torch.ops.strait_torch.paged_decode_triton(*args).unsqueeze(0)
    return paged_decode_triton(*args).unsqueeze(0)


def _compiled_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """A compiled decode step (CUDA graphs with engine.compile), traced by
    ``paged_attention``: the cache write and the gather stay one opaque op, so the compiler
    never copies the cache to functionalise the in-place write."""
    assert meta.decode_token_idx is not None
    assert meta.decode_block_ids is not None and meta.decode_mask is not None
    out = torch.ops.strait_torch.paged_decode(
        query[0],
        key[0],
        value[0],
        meta.cache.data,
        layer,
        meta.slot_mapping,
        None if meta.decode_all else meta.decode_token_idx,
        meta.decode_block_ids,
        meta.decode_mask,
        scale,
    )
    return out.unsqueeze(0)


def _torch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """torch's kernels (``paged_attention``'s fallback, for each layer): the cache write, then
    the decode tokens as one padded SDPA and each prefill chunk as one SDPA."""
    k_cache, v_cache = meta.cache.layer(layer)
    hkv, _, _, d = k_cache.shape
    # 1. Write the new K/V into their slots (rounded to the cache's dtype, engine.kv_cache_dtype).
    write_kv(k_cache, v_cache, meta.slot_mapping, key[0], value[0])
    _, h, t, _ = query.shape
    groups = h // hkv
    q = query[0].to(ACT)  # [H, T, D]

    # 2a. Decode tokens: one padded, batched SDPA.
    if meta.decode_token_idx is not None:
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        idx = None if meta.decode_all else meta.decode_token_idx
        od = decode_rows(q, k_cache, v_cache, idx, meta.decode_block_ids, meta.decode_mask, scaling)
        if meta.decode_all:
            return od.to(query.dtype).unsqueeze(0)
    out = query.new_empty(t, h, d)  # [T, H, D]
    if meta.decode_token_idx is not None:
        out.index_copy_(0, meta.decode_token_idx, od.to(out.dtype))

    # 2b. Prefill chunks: one SDPA per sequence.
    for seg in meta.prefills:
        s, n = seg.q_start, seg.q_len
        # [H, n, D] -> [Hkv, G * n, D] (row g*n + i: query i of group member g)
        qs = q[:, s : s + n].reshape(hkv, groups * n, d)
        ks = k_cache.index_select(1, seg.block_ids).view(hkv, -1, d)[:, : seg.ctx_len].to(ACT)
        vs = v_cache.index_select(1, seg.block_ids).view(hkv, -1, d)[:, : seg.ctx_len].to(ACT)
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, scale=scaling)
        # [Hkv, G * n, D] -> [H, n, D] -> [n, H, D]
        out[s : s + n] = os_.view(h, n, d).transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0)


# Scores and softmax in float32 whatever the activations' and the cache's dtypes: with
# attention in bf16 a batched bf16 engine diverged from one request at a time on a test prompt
# that agrees in float32 (bf16 with unquantised weights still diverges on another:
# test_quant.py's strict xfail). Only the output is rounded back to the activations' dtype.
ACT = torch.float32


def write_kv(
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] long
    key: torch.Tensor,  # [Hkv, T, D]
    value: torch.Tensor,
) -> None:
    """Write the step's K/V into their slots, rounded to the cache's dtype."""
    hkv, num_blocks, block_size, d = k_cache.shape
    k_slots = k_cache.view(hkv, num_blocks * block_size, d)
    k_slots.index_copy_(1, slot_mapping, key.to(k_cache.dtype))
    v_slots = v_cache.view(hkv, num_blocks * block_size, d)
    v_slots.index_copy_(1, slot_mapping, value.to(v_cache.dtype))


def decode_rows(
    q: torch.Tensor,  # [H, T, D] float32
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    token_idx: torch.Tensor | None,  # [B] long: the decode tokens' packed positions (None: all)
    block_ids: torch.Tensor,  # [B * max_blocks] long
    mask: torch.Tensor,  # [1, B, 1, max_blocks * block_size] bool
    scaling: float | None,
) -> torch.Tensor:
    """Attention of the decode tokens (one query each) over their padded blocks, one batched
    SDPA; returns ``[B, H, D]`` float32."""
    hkv, d = k_cache.shape[0], k_cache.shape[3]
    h = q.shape[0]
    groups = h // hkv
    if token_idx is not None:
        q = q.index_select(1, token_idx)
    b = q.shape[1]
    # [H, B, D] -> [Hkv, G, B, D] -> [Hkv, B, G, D]
    qd = q.view(hkv, groups, b, d).transpose(1, 2)
    # [Hkv, B * max_blocks, block_size, D] is already [Hkv, B, L_max, D] in memory.
    kd = k_cache.index_select(1, block_ids).view(hkv, b, -1, d).to(ACT)
    vd = v_cache.index_select(1, block_ids).view(hkv, b, -1, d).to(ACT)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scaling)
    # [Hkv, B, G, D] -> [B, Hkv, G, D] -> [B, H, D]
    return od.transpose(0, 1).reshape(b, h, d)


@torch.library.custom_op("strait_torch::paged_decode", mutates_args=("kv",))
def paged_decode(
    query: torch.Tensor,  # [H, T, D], every token a decode token
    key: torch.Tensor,  # [Hkv, T, D]
    value: torch.Tensor,
    kv: torch.Tensor,  # the whole cache: [layers, 2, Hkv, num_blocks, block_size, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T]
    token_idx: torch.Tensor | None,  # [T]; None: every token in order
    block_ids: torch.Tensor,  # [T * max_blocks]
    mask: torch.Tensor,  # [1, T, 1, max_blocks * block_size]
    scale: float,
) -> torch.Tensor:
    """:func:`write_kv` then :func:`decode_rows` for a step of decode tokens only, as one op
    that ``torch.compile`` keeps opaque; returns ``[T, H, D]`` in the query's dtype."""
    k_cache, v_cache = kv[layer, 0], kv[layer, 1]
    write_kv(k_cache, v_cache, slot_mapping, key, value)
    od = decode_rows(query.to(ACT), k_cache, v_cache, token_idx, block_ids, mask, scale)
    if token_idx is None:  # contiguous, as the fake kernel says (SDPA's output may not be)
        return od.to(query.dtype).contiguous()
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
    return out.index_copy_(0, token_idx, od.to(out.dtype))


@paged_decode.register_fake
def _paged_decode_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    token_idx: torch.Tensor | None,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return query.new_empty(query.shape[1], query.shape[0], query.shape[2])  # [T, H, D]


def causal_mask(q_start_pos: int, q_len: int, ctx_len: int, groups: int) -> torch.Tensor:
    """[groups * q_len, ctx_len] bool: query i (absolute position q_start_pos + i) sees keys
    0..q_start_pos + i. Rows repeat per group member to match the folded GQA layout."""
    q_pos = torch.arange(q_start_pos, q_start_pos + q_len).repeat(groups)  # [G * q_len]
    return torch.arange(ctx_len).unsqueeze(0) <= q_pos.unsqueeze(1)


_registered = False


def register() -> None:
    """Register :func:`paged_attention` with transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        _registered = True


@torch.library.custom_op("strait_torch::paged_decode_triton", mutates_args=("kv",))
def paged_decode_triton(
    query: torch.Tensor,  # [H, T, D]
    key: torch.Tensor,  # [Hkv, T, D]
    value: torch.Tensor,
    kv: torch.Tensor,  # the whole cache: [layers, 2, Hkv, num_blocks, block_size, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T]
    tables: torch.Tensor,  # [T, max_blocks]: each token's sequence's blocks
    lens: torch.Tensor,  # [T]: each token's position + 1
    scale: float,
) -> torch.Tensor:
    """Triton's K/V write (every token of the step, one kernel), then its paged kernel with
    every token one query row over its own sequence's blocks; returns ``[T, H, D]`` in the
    query's dtype."""
    from libs.engine import triton_attention

    k_cache, v_cache = kv[layer, 0], kv[layer, 1]
    triton_attention.write_kv(k_cache, v_cache, slot_mapping, key, value)
    q = query.transpose(0, 1)  # [T, H, D], a view
    return triton_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, query.dtype)


@paged_decode_triton.register_fake
def _paged_decode_triton_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return query.new_empty(query.shape[1], query.shape[0], query.shape[2])  # [T, H, D]
