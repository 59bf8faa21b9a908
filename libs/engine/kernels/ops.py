"""Shape functions of Strait's CPU kernels as dispatcher ops (``torch.ops.strait.*``).

``bindings.cpp`` registers ``strait::packed_linear`` and ``strait::paged_attention`` with
torch's dispatcher (``TORCH_LIBRARY``) beside its pybind11 functions. ``torch.compile`` cannot
trace into C++; with the "fake" kernels below it knows each op's output shape and keeps the op
as an opaque node, fusing only transformers' small ops around it. :func:`register_fakes` runs
once, right after :func:`libs.engine.kernels.build` loads the library. The model runner compiles
its forward when ``engine.compile`` is on (decision 0006).
"""

from __future__ import annotations

import torch

_done = False


def register_fakes() -> None:
    """Register the fake kernels (idempotent); the library must already be loaded."""
    global _done
    if _done:
        return

    @torch.library.register_fake("strait::packed_linear")  # type: ignore[misc]
    def _packed_linear(
        x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [M, K] -> [M, n]

    @torch.library.register_fake("strait::block_linear")  # type: ignore[misc]
    def _block_linear(
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        n: int,
        bits: int,
        group: int,
        act_bits: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [M, K] -> [M, n]

    @torch.library.register_fake("strait::paged_attention")  # type: ignore[misc]
    def _paged_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H, D]

    _done = True
