"""8-bit weights, one scale per output feature, on torch's int8 weight-only matmul.

Kernel: ``torch._weight_int8pack_mm`` (CPU and CUDA; the op torchao's ``int8_weight_only``
lowers to), ``y = (x @ qᵀ) * scale`` with ``q`` int8 ``[out, in]`` and bf16 ``scale [out]``.
The op has one scale per output row, so ``int8`` is per-channel (symmetric, absmax / 127),
not group-wise: finer groups would need a kernel of our own (the quality table in
docs/engine.md says what per-channel costs).
"""

from __future__ import annotations

import torch

from libs.engine.quant.base import KERNEL_DTYPE, WeightOnlyLinear
from libs.engine.quant.blocks import FP16_TINY, Blocks, fp16_exact

# Fractions of a row's absmax tried as its clipping point (1.0 first: no clipping).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


class Int8Linear(WeightOnlyLinear):
    kind = "int8"
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] bfloat16

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        out_features, in_features = q.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(KERNEL_DTYPE).contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Re-quantise any float weight (a GGUF block type no kernel reads) per row."""
        b = int8_blocks(weight)
        return cls(b.q, b.d[:, 0], bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scale)


def int8_blocks(weight: torch.Tensor) -> Blocks:
    """``engine.quantization = "int8"``: symmetric, one scale per row (``group`` = the row).
    Each row's scale is the one of :data:`CLIP_RATIOS` × absmax / 127 with the least squared
    error (outliers clipped where that pays), rounded to fp16 before the levels are chosen. On
    SmolLM2 the search took int8's perplexity from +1.05% to +0.90% of float32 (``strait
    bench quality``, torch's kernel)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # [out]
    best_err = torch.full_like(amax, float("inf"))
    best_scale = torch.ones_like(amax)
    for ratio in CLIP_RATIOS:
        scale = fp16_exact((ratio * amax / 127).clamp(min=FP16_TINY))
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        err = ((q * scale[:, None] - w) ** 2).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    q = torch.round(w / best_scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Blocks(q, best_scale[:, None], None, 8, w.shape[1])
