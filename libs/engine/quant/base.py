"""The interface every weight format's linear layer implements.

:func:`libs.engine.quant.quantize_model` swaps a model's ``nn.Linear`` layers for subclasses of
:class:`WeightOnlyLinear` once, at load; transformers' modelling code calls them as it called
the linears. Weights stay in their stored format; only the activations change dtype around
torch's kernels (fast with bfloat16 activations and scales only; Strait's block kernel takes
float32, ``blocks.BlockLinear``), so a model kept in float32 keeps float32 norms, residuals,
attention and KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

# The activation dtype the weight-only kernels take on every device (torch 2.13: int4 and int8
# on the CPU are ~10x slower with float32 or float16 activations; the CUDA kernels take bf16).
KERNEL_DTYPE = torch.bfloat16


class WeightOnlyLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in a narrower format; any leading shape of ``x``.

    Subclasses hold their weight tensors as buffers and implement :meth:`matmul` on a
    ``[M, in_features]`` bfloat16 input, returning ``[M, out_features]`` bfloat16."""

    kind = "?"  # the format's name in logs and `strait models` (e.g. "int4-g32")

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of weight data one forward reads (scales included)."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.matmul(x2.to(KERNEL_DTYPE)).to(x.dtype)  # [M, out_features]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Bf16Linear(WeightOnlyLinear):
    """Weights in bfloat16 through ``F.linear`` (cuBLAS): the CUDA fallback for 4-bit blocks
    whose input width does not fit tinygemm's tiles (``serve.make_linear``)."""

    kind = "bf16"
    weight_bf16: torch.Tensor  # [out, in] bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_bf16", weight.to(KERNEL_DTYPE).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight_bf16)
