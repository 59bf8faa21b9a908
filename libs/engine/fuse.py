"""One linear where a layer reads the same input several times (``engine.fuse_projections``).

Called once by :class:`~libs.engine.model_runner.ModelRunner` at start, after the weights are in
their format (:func:`libs.engine.quant.quantize_model`) and before the CPU kernels pack what is
left. In every decoder layer of a known family

- attention's ``q_proj``, ``k_proj``, ``v_proj`` become one ``qkv_proj``,
- the MLP's ``gate_proj`` and ``up_proj`` become one ``gate_up_proj``,

their weights concatenated along the outputs, and the module's class swapped for a subclass
whose ``forward`` splits the one output where the original called three (or two) layers. Each
output row is the same dot product over the same inputs in either form (no kernel splits the
inputs across threads), so fusing never changes the answer; it saves three kernel calls a layer
and their thread fork/join (~90 calls of ~240 a SmolLM2 step).

Only layer classes whose ``forward`` is transformers' llama code are fused (checked against
``LlamaAttention.forward`` / ``LlamaMLP.forward`` themselves), and only linears of one kind that
concatenate exactly: ``nn.Linear`` of one dtype, or :class:`~libs.engine.quant.BlockLinear` of
one format with whole panel groups. Anything else is left as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from libs.engine.quant.blocks import BlockLinear

log = logging.getLogger("strait.engine")

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def concat_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``cat([layer(x) for layer in layers], -1)``, or None when they do
    not concatenate exactly (different kinds or formats, padded block panels)."""
    if all(type(m) is nn.Linear for m in layers):
        linears: list[nn.Linear] = layers  # type: ignore[assignment]
        w = linears[0].weight
        if any(m.weight.dtype != w.dtype or m.weight.device != w.device for m in linears):
            return None
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) != all(b is None for b in biases):
            return None
        out = nn.Linear(
            w.shape[1],
            sum(m.out_features for m in linears),
            bias=biases[0] is not None,
            device=w.device,
            dtype=w.dtype,
        )
        out.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
        if out.bias is not None:
            cat_b = torch.cat([b for b in biases if b is not None])
            out.bias = nn.Parameter(cat_b, requires_grad=False)
        return out
    if all(type(m) is BlockLinear for m in layers):
        return BlockLinear.concat(layers)  # type: ignore[arg-type]
    return None


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``LlamaAttention.forward`` (transformers 5) with one projection in."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.strait_split, dim=-1)
    query = q.view(hidden_shape).transpose(1, 2)  # [1, H, T, D]
    key = k.view(hidden_shape).transpose(1, 2)  # [1, Hkv, T, D]
    value = v.view(hidden_shape).transpose(1, 2)
    assert position_embeddings is not None
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    if cache is not None:  # transformers' own generate; Strait's engine passes none
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    out, weights = attend(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward`` with one projection for the gate and the up branch."""
    gate, up = self.gate_up_proj(x).split(self.strait_split, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


_fused_classes: dict[type, type] = {}


def _fused_class(cls: type, forward: Callable[..., Any]) -> type:
    """A subclass of ``cls`` with ``forward`` (one per class, so modules keep one type)."""
    if cls not in _fused_classes:
        _fused_classes[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": forward})
    return _fused_classes[cls]


def _fuse(
    module: nn.Module, parts: tuple[str, ...], name: str, forward: Callable[..., Any]
) -> bool:
    layers = [getattr(module, p) for p in parts]
    merged = concat_linears(layers)
    if merged is None:
        return False
    module.strait_split = [int(m.out_features) for m in layers]  # type: ignore[assignment]
    for p in parts:
        delattr(module, p)
    module.add_module(name, merged)
    module.__class__ = _fused_class(type(module), forward)
    return True


def _same_code(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions run the same code (copies of one function across model files
    compile to the same bytecode and names)."""
    ca = getattr(a, "__code__", None)
    cb = getattr(b, "__code__", None)
    return (
        ca is not None
        and cb is not None
        and ca.co_code == cb.co_code
        and ca.co_names == cb.co_names
        and ca.co_consts == cb.co_consts
    )


def fuse_projections(model: nn.Module) -> int:
    """Fuse ``model``'s attention and MLP input projections in place (see the module
    docstring); returns how many fused layers it made."""
    n = 0
    for module in list(model.modules()):
        cls = type(module)
        if cls.forward is LlamaAttention.forward and all(hasattr(module, p) for p in QKV):
            n += _fuse(module, QKV, "qkv_proj", _attention_forward)
        elif _same_code(cls.forward, LlamaMLP.forward) and all(
            hasattr(module, p) for p in (*GATE_UP, "down_proj", "act_fn")
        ):
            n += _fuse(module, GATE_UP, "gate_up_proj", _mlp_forward)
    if n:
        log.info("fused %d input projections (q/k/v, gate/up)", n)
    return n
