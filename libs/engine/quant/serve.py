"""Which layer serves a linear's :class:`~libs.engine.quant.blocks.Blocks`: Strait's block
kernel where it serves the model, torch's int4 / int8 weight-only ops or bfloat16 weights
elsewhere (the list in :mod:`libs.engine.quant.blocks`). Called by every format's builder
(``quant/__init__.py``, ``quant/gguf.py``); it sits above the layer modules it chooses from.
"""

from __future__ import annotations

from typing import Any

import torch

from libs.engine.quant.base import Bf16Linear, WeightOnlyLinear
from libs.engine.quant.blocks import BlockLinear, Blocks
from libs.engine.quant.int4 import Int4Linear
from libs.engine.quant.int8 import Int8Linear

TINYGEMM_K = 256  # input features per tinygemm K tile at innerKTiles 8 (CUDA int4)


def make_linear(
    blocks: Blocks,
    bias: torch.Tensor | None,
    kernels: Any | None,
    device: torch.device,
    act_bits: int = 32,
) -> WeightOnlyLinear:
    """The layer serving ``blocks`` (see the module docstring for which); built on
    ``device``. ``kernels``: the loaded CPU kernels when :func:`kernel_serves`, else None."""
    if kernels is not None:
        # int8 activation blocks need an integer dot (AVX-512 VNNI, or AVX2's vpmaddubsw)
        # and groups of 32 inputs; else the exact path.
        if act_bits == 8 and not (getattr(kernels, "int8_dot", False) and blocks.group % 32 == 0):
            act_bits = 32
        return BlockLinear(blocks, bias, kernels, act_bits)
    k = blocks.q.shape[1]
    if device.type == "cuda" and blocks.bits == 4 and k % TINYGEMM_K:
        # tinygemm packs K in tiles of 256 (SmolLM2's 576 inputs do not fit): bf16 weights.
        return Bf16Linear(blocks.dequantized().to(device), bias)
    if blocks.bits == 4:  # torch's formula: (q - 8) * scale + zero
        zero = blocks.m + 8 * blocks.d if blocks.m is not None else torch.zeros_like(blocks.d)
        return Int4Linear(
            blocks.q.to(device), blocks.d.to(device), zero.to(device), blocks.group, bias
        )
    if blocks.group == blocks.q.shape[1] and blocks.m is None:  # one scale per row already
        return Int8Linear(blocks.q.to(device), blocks.d[:, 0].to(device), bias)
    return Int8Linear.from_float(blocks.dequantized().to(device), bias)
