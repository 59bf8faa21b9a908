"""Paged decode attention on a CUDA device as one Triton kernel (decision 0018).

Every step on CUDA calls it once per layer, after the step's K/V are written into their slots
(:func:`write_kv`, one kernel for keys and values): every token row reads its own sequence's blocks in
place through its block table, ``TILE`` keys at a time, with a running (online) softmax in
float32, so nothing is gathered, padded or masked in memory; the keys past a row's context
length are masked in registers. One program per (row, KV head) computes the ``G`` query heads
that share the KV head (GQA without repeating K/V).

The torch path it replaces (``attention.decode_rows``: two gathers of whole blocks, their
float32 copies, a boolean mask, SDPA and a transpose) is about ten kernels a layer and reads
each row's padded table several times over; this is one kernel reading each key once.

Triton ships with torch's CUDA wheels; without it (a CPU build) :data:`AVAILABLE` is False and
the engine keeps the torch path.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheels carry no Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
# Keys a program reads per iteration: two blocks of 16.
TILE = 32


def supports(head_dim: int) -> bool:
    """Whether the kernel serves a model of this head size (Triton ranges are powers of 2)."""
    return AVAILABLE and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit  # type: ignore[misc]
    def _write_kv_kernel(
        k_ptr,  # [Hkv, T, D] the step's keys in the cache's dtype (D contiguous)
        v_ptr,  # the same for values
        k_cache_ptr,  # [Hkv, num_blocks * block_size, D] one layer's keys, contiguous
        v_cache_ptr,
        slots_ptr,  # [T] int64: flat slot of each token
        stride_kh,
        stride_kt,
        stride_vh,
        stride_vt,
        stride_ch,
        D: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.arange(0, D)
        slot = tl.load(slots_ptr + t)
        k = tl.load(k_ptr + h * stride_kh + t * stride_kt + offs_d)
        v = tl.load(v_ptr + h * stride_vh + t * stride_vt + offs_d)
        dst = h * stride_ch + slot * D + offs_d
        tl.store(k_cache_ptr + dst, k)
        tl.store(v_cache_ptr + dst, v)

    @triton.jit  # type: ignore[misc]
    def _paged_decode_kernel(
        q_ptr,  # [B, H, D], D contiguous
        k_ptr,  # [Hkv, num_blocks, block_size, D] (one layer's keys)
        v_ptr,  # the same for values
        tables_ptr,  # [B, W] int64
        lens_ptr,  # [B] int64: keys each row sees (its position + 1)
        out_ptr,  # [B, H, D]
        scale,
        stride_qb,
        stride_qh,
        stride_kh,
        stride_kn,
        stride_kt,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUPS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, TILE)
        g_ok = offs_g < GROUPS
        heads = kvh * GROUPS + offs_g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        ctx = tl.load(lens_ptr + b)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_kh
        for start in range(0, ctx, TILE):
            pos = start + offs_t
            t_ok = pos < ctx
            block = tl.load(tables_ptr + b * stride_tb + pos // BS, mask=t_ok, other=0)
            off = block[:, None] * stride_kn + (pos % BS)[:, None] * stride_kt + offs_d[None, :]
            k = tl.load(k_base + off, mask=t_ok[:, None], other=0.0).to(tl.float32)  # [TILE, D]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, TILE]
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out,
            mask=g_ok[:, None],
        )


def write_kv(
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    key: torch.Tensor,  # [Hkv, T, D]
    value: torch.Tensor,
) -> None:
    """The step's K/V into their slots, rounded to the cache's dtype: one kernel for both
    (``attention.write_kv``'s two ``index_copy_`` and their casts, in one launch)."""
    assert triton is not None
    hkv, t, d = key.shape
    # Rounded by torch (to nearest even), as attention.write_kv rounds: a narrower cache than
    # the activations (engine.kv_cache_dtype) costs one cast kernel each.
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if t == 0:
        return
    _write_kv_kernel[(t, hkv)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        D=d,
    )


def paged_decode(
    q: torch.Tensor,  # [B, H, D], last dim contiguous (a view of [H, B, D] is fine)
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [B, W] int64: each row's blocks, padded
    lens: torch.Tensor,  # [B] int64: keys each row sees
    scale: float,
    out_dtype: torch.dtype = torch.float32,
    *,
    tile: int = TILE,
    num_warps: int = 4,
) -> torch.Tensor:
    """Each row's query heads over its own blocks (float32 inside); returns ``[B, H, D]`` in
    ``out_dtype``, rounded once by the kernel's store. ``tile`` (keys an iteration, a power of
    two) and ``num_warps`` are the launch's shape (bench.gpu_step sweeps them)."""
    assert triton is not None
    b, h, d = q.shape
    hkv, _, block_size, _ = k_cache.shape
    groups = h // hkv
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty(b, h, d, dtype=out_dtype, device=q.device)
    _paged_decode_kernel[(b, hkv)](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUPS=groups,
        BLOCK_G=triton.next_power_of_2(groups),
        D=d,
        BS=block_size,
        TILE=tile,
        num_warps=num_warps,
    )
    return out
