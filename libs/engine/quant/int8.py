"""8-bit weights, one scale per output feature, on torch's int8 weight-only matmul.

Kernel: ``torch._weight_int8pack_mm`` (CPU and CUDA; the op torchao's ``int8_weight_only``
lowers to), ``y = (x @ qᵀ) * scale`` with ``q`` int8 ``[out, in]`` and bf16 ``scale [out]``.
The op has one scale per output row, so ``int8`` is per-channel (symmetric, absmax / 127),
not group-wise: finer groups would need a kernel of our own, and at 8 bits the per-channel
error is already small (the quality table in docs/engine.md).
"""

from __future__ import annotations

import torch

from libs.engine.quant.base import KERNEL_DTYPE, WeightOnlyLinear


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
        """Symmetric per-row quantisation; the scale is rounded to bf16 before the levels."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(KERNEL_DTYPE).float()  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        return cls(q, scale, bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scale)
