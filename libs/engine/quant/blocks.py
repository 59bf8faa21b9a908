"""Block-quantized weights, served from their levels by Strait's CPU kernel or torch's ops.

Every format's builder (``gguf``, ``int4``, ``int8``) describes each linear as :class:`Blocks`
(levels, fp16 scales and offsets per group of inputs, in the model's row order), and
:func:`libs.engine.quant.serve.make_linear` picks the layer that serves it:

- :class:`BlockLinear` — Strait's ``block_linear`` kernel (AVX2 or AVX-512 CPUs, float32 models):
  float32 activations, each weight widened in registers exactly as the ``gguf`` package
  dequantises it, so a model served from a GGUF's Q4_0 / Q4_1 / Q8_0 blocks gives the bits of
  the float32 model converted from that GGUF (docs/decisions/0009-block-quantized-kernel.md);
- elsewhere (CUDA, CPUs without AVX2, bf16 models): torch's weight-only ops on bf16
  activations, :class:`~libs.engine.quant.int4.Int4Linear` (``_weight_int4pack_mm``) for
  4-bit levels and :class:`~libs.engine.quant.int8.Int8Linear` (``_weight_int8pack_mm``, one
  scale per row: group-wise 8-bit blocks are re-quantised per row) for 8-bit ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from libs.engine.quant.base import WeightOnlyLinear

PANEL = 16  # output columns per panel (kernels/kernels.h kNR)
PANELS_PER_GROUP = 4  # panels interleaved chunk by chunk (kPanelsPerGroup)
GROUP_ROWS = PANEL * PANELS_PER_GROUP
FP16_TINY = 2.0**-14  # smallest normal fp16: scales never round to zero or lose bits


@dataclass(slots=True)
class Blocks:
    """One linear's weights, per group of ``group`` inputs with scale ``d`` (and offset ``m``):
    4 bits ``w = q * d + m`` (Q4_1), or ``(q - 8) * d`` without offsets (Q4_0); 8 bits
    ``w = q * d`` (Q8_0). Each product and sum is rounded to float32 in that order, as the
    ``gguf`` package dequantises."""

    q: torch.Tensor  # [N, K] integer levels: 0..15 (4 bits) or -128..127 (8 bits)
    d: torch.Tensor  # [N, K / group] float32, each exactly an fp16 value
    m: torch.Tensor | None  # like d (4 bits only); None: no offsets
    bits: int  # 4 or 8
    group: int

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32, rounded as the kernel and the ``gguf`` package round."""
        n, k = self.q.shape
        q = self.q.float() - (8 if self.bits == 4 and self.m is None else 0)
        w = q.view(n, -1, self.group) * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.view(n, k)


def fp16_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest fp16 value, as float32."""
    return t.to(torch.float16).float()


def pack(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (``kernels/block_layout.h``): panels of 16 rows,
    four panels to a group interleaved chunk by chunk; levels uint8 ``[G, K / 8, 4, 16, 4]``
    (4 bits: byte ``(c, s, j, t)`` = ``q[r, 8c + t] | q[r, 8c + 4 + t] << 4`` of row ``r = 16
    (4g + s) + j``) or ``[G, K / 4, 4, 16, 4]`` (8 bits: ``q[r, 4c + t] + 128``); scales and
    offsets fp16 ``[G, K / group, 4, 16]`` (offsets empty when there are none); rows padded
    with zeros to a multiple of 64."""
    n, k = blocks.q.shape
    pad = -n % GROUP_ROWS
    q = torch.nn.functional.pad(blocks.q.to(torch.int32), (0, 0, 0, pad))
    groups = (n + pad) // GROUP_ROWS

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [N', C, *rest] -> [G, C, 4, 16, *rest]
        t = t.reshape(groups, PANELS_PER_GROUP, PANEL, *t.shape[1:])
        return t.movedim(3, 1).contiguous()

    if blocks.bits == 4:
        halves = q.view(n + pad, k // 8, 2, 4)  # [N', chunk, low / high nibble, t]
        packed = halves[:, :, 0] | halves[:, :, 1] << 4  # [N', K / 8, 4]
    else:
        packed = (q + 128).view(n + pad, k // 4, 4)
    qweight = by_group(packed.to(torch.uint8))
    d = torch.nn.functional.pad(blocks.d, (0, 0, 0, pad))
    scales = by_group(d.to(torch.float16))
    mins = torch.empty(0, dtype=torch.float16)
    if blocks.m is not None:
        mins = by_group(torch.nn.functional.pad(blocks.m, (0, 0, 0, pad)).to(torch.float16))
    return qweight, scales, mins


class BlockLinear(WeightOnlyLinear):
    """Levels and fp16 scales in the kernel's panels; float32 activations in and out."""

    qweight: torch.Tensor  # [G, K / 8, 4, 16, 4] (4 bits) or [G, K / 4, 4, 16, 4] (8 bits) uint8
    scales: torch.Tensor  # [G, K / group, 4, 16] float16
    mins: torch.Tensor  # [G, K / group, 4, 16] float16, or empty

    def __init__(
        self, blocks: Blocks, bias: torch.Tensor | None, kernels: Any, act_bits: int = 32
    ) -> None:
        out_features, in_features = blocks.q.shape
        super().__init__(in_features, out_features, bias)
        self.kernels = kernels
        self.bits = blocks.bits
        self.group = blocks.group
        # 32: float32 activations, the float model's bits; 8: int8 activation blocks (VNNI).
        self.act_bits = act_bits
        self.kind = f"block-q{blocks.bits}-g{blocks.group}" + ("-a8" if act_bits == 8 else "")
        qweight, scales, mins = pack(blocks)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def concat(cls, layers: list[BlockLinear]) -> BlockLinear | None:
        """One layer whose outputs are ``layers``' outputs side by side, sharing their packed
        levels (each output row is computed as before); None unless all are one format and all
        but the last fill whole groups of panels (padding rows would sit between them)."""
        first = layers[0]
        fmt = (first.in_features, first.bits, first.group, first.act_bits, first.mins.numel() > 0)
        if any(
            (m.in_features, m.bits, m.group, m.act_bits, m.mins.numel() > 0) != fmt for m in layers
        ) or any(m.out_features % GROUP_ROWS for m in layers[:-1]):
            return None
        if any(m.bias is None for m in layers) != all(m.bias is None for m in layers):
            return None
        bias = None if first.bias is None else torch.cat([m.bias for m in layers])  # type: ignore[misc]
        out = cls.__new__(cls)
        WeightOnlyLinear.__init__(out, first.in_features, sum(m.out_features for m in layers), bias)
        out.kernels, out.bits, out.group = first.kernels, first.bits, first.group
        out.act_bits, out.kind = first.act_bits, first.kind
        for name in ("qweight", "scales", "mins"):
            parts = [getattr(m, name) for m in layers]
            out.register_buffer(
                name, parts[0] if name == "mins" and not parts[0].numel() else torch.cat(parts)
            )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        args = (
            x2,
            self.qweight,
            self.scales,
            self.mins,
            self.out_features,
            self.bits,
            self.group,
            self.act_bits,
        )
        if torch.compiler.is_compiling():
            y = torch.ops.strait.block_linear(*args, self.bias)
        else:
            y = self.kernels.block_linear(*args, self.bias)
        return y.view(*lead, self.out_features)


def kernel_serves(kernels: Any, dtype: torch.dtype, device: torch.device) -> bool:
    """True when :class:`BlockLinear` can serve a model in ``dtype`` on ``device``."""
    return (
        kernels is not None
        and bool(getattr(kernels, "avx2", False))  # block_linear is built with the AVX2 paths
        and dtype == torch.float32
        and device.type == "cpu"
    )
