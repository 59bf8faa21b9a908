"""``nn.Linear`` layers swapped for the packed-weight kernel.

The model runner calls :func:`pack_linears` once, after loading, when the CPU kernels are in
use. Each float32 ``nn.Linear`` becomes a :class:`PackedLinear` holding its weight as
``[ceil(out / 16), in, 16]`` panels (see ``packed_linear.cpp``); transformers' modelling code is
unchanged and calls it as it called the linear. A weight shared with another module (a tied LM
head) keeps its original tensor as well, so the embedding still reads it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from libs.engine import host_memory


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` over pre-packed weights; any leading shape, last dim ``in_features``."""

    packed: torch.Tensor  # [ceil(out / 16), in, 16] float32 (a buffer)

    def __init__(self, linear: nn.Linear, kernels: Any, keep_weight: bool) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # [ceil(out / 16), in, 16] float32
        self.register_buffer(
            "packed", kernels.pack_weight(linear.weight.detach()), persistent=False
        )
        self.bias = linear.bias
        # Only when another module shares it (tied embeddings); otherwise the original is freed.
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.strait.packed_linear(x2, self.packed, self.out_features, self.bias)
        else:
            y = self.kernels.packed_linear(x2, self.packed, self.out_features, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module, kernels: Any) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` in place; returns how many."""
    refs: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        refs[id(p)] = refs.get(id(p), 0) + 1
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
    ]
    packed: list[PackedLinear] = []
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        shared = refs.get(id(linear.weight), 0) > 1
        packed.append(PackedLinear(linear, kernels, keep_weight=shared))
        setattr(parent, child, packed[-1])
    _move_to_huge_pages(packed)
    return len(targets)


def _move_to_huge_pages(layers: list[PackedLinear]) -> None:
    """Every packed weight into one arena on huge pages (see host_memory): each step streams
    all of them, and 4 KiB pages cost the one-row linear ~6% in page walks."""
    for layer, view in zip(layers, host_memory.gather([x.packed for x in layers]), strict=True):
        layer.packed = view
