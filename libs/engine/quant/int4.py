"""4-bit weights, group-wise scale and zero, on torch's int4 weight-only matmul.

Kernels: ``torch._weight_int4pack_mm_for_cpu`` on the CPU, ``torch._weight_int4pack_mm`` (the
tinygemm kernel torchao's ``int4_weight_only`` uses) on CUDA; both compute, per group of
``group`` input features, ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 and bf16
``scale``/``zero``. Weights come from a float checkpoint (:func:`int4_blocks`, asymmetric min/max per group) or
straight from a GGUF's 4-bit blocks (:mod:`libs.engine.quant.gguf`: Q4_0, Q4_1, Q4_K map onto
the same formula); on AVX2 / AVX-512 CPUs Strait's own kernel serves them instead
(:mod:`libs.engine.quant.blocks`).
"""

from __future__ import annotations

import torch

from libs.engine.quant.base import KERNEL_DTYPE, WeightOnlyLinear
from libs.engine.quant.blocks import FP16_TINY, Blocks, fp16_exact


class Int4Linear(WeightOnlyLinear):
    """One linear's int4 weights, packed once for the device's kernel."""

    packed: torch.Tensor  # CPU: [out, in / 2] uint8; CUDA: tinygemm's tiled int32 layout
    scales_zeros: torch.Tensor  # [in / group, out, 2] bfloat16: (scale, zero) per group

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``q``: ``[out, in]`` integers 0..15; ``scale``, ``zero``: ``[out, in / group]``."""
        out_features, in_features = q.shape
        if in_features % group:
            raise ValueError(f"in_features {in_features} is not a multiple of group {group}")
        super().__init__(in_features, out_features, bias)
        self.group = group
        self.kind = f"int4-g{group}"
        # Both packers want whole tiles of 16 output rows: pad with zeros, slice the output.
        pad = -out_features % 16
        q32 = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad)).contiguous()
        scale = torch.nn.functional.pad(scale, (0, 0, 0, pad))
        zero = torch.nn.functional.pad(zero, (0, 0, 0, pad))
        if q32.is_cuda:
            # tinygemm wants the two nibbles of a byte as (even << 4 | odd) in uint8 first.
            u8 = (q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8)
            packed = torch._convert_weight_to_int4pack(u8, 8)  # K % 256 == 0 (serve.make_linear)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q32, 1)
        self.register_buffer("packed", packed)
        sz = torch.stack([scale.t(), zero.t()], dim=-1)  # [in / group, out, 2]
        self.register_buffer("scales_zeros", sz.to(KERNEL_DTYPE).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            y = torch._weight_int4pack_mm(x, self.packed, self.group, self.scales_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        return y[:, : self.out_features]


def int4_blocks(weight: torch.Tensor, group: int) -> Blocks:
    """``engine.quantization = "int4"``: ``weight [out, in]`` in asymmetric 4-bit groups of
    ``group`` inputs, ``w = q * d + m`` with the group's minimum ``m`` and range / 15 ``d``.
    Both are rounded to fp16 *before* the levels are chosen, so the levels fit the numbers
    every kernel uses."""
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    lo = w.amin(dim=-1)
    d = fp16_exact(((w.amax(dim=-1) - lo) / 15).clamp(min=FP16_TINY))
    m = fp16_exact(lo)
    q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15)
    return Blocks(q.reshape(out_features, in_features).to(torch.uint8), d, m, 4, group)
