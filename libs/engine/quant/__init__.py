"""Weight formats (``engine.quantization``): one module per format behind one interface.

:func:`quantize_model` is called once by :func:`libs.engine.loader.load_model`, after
transformers has loaded the float model and before the CPU kernels pack what is left; it
replaces every ``nn.Linear`` with a :class:`~libs.engine.quant.base.WeightOnlyLinear` of the
chosen format and returns a :class:`QuantReport` (the model runner logs the layers in use once
at start-up, ``ModelRunner.weights_summary``).

| format | module | kernel (CPU / CUDA) |
| --- | --- | --- |
| ``none`` | — | the model's dtype: Strait's packed fp32 linears, or ``F.linear`` |
| ``gguf`` | :mod:`.gguf` | the source GGUF's blocks (Q4_0/Q4_1/Q8_0 as stored; Q4_K; others int8) |
| ``int4`` | :mod:`.int4` | asymmetric 4-bit groups (``quant_group_size``); the LM head int8 |
| ``int8`` | :mod:`.int8` | symmetric 8-bit, one scale per output row |

Kernels (:mod:`.blocks`): Strait's ``block_linear`` on AVX2 / AVX-512 CPUs for float32 models
(float32 activations); torch's ``_weight_int4pack_mm(_for_cpu)`` / ``_weight_int8pack_mm`` elsewhere,
CUDA included (bf16 activations).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from libs.engine import host_memory
from libs.engine.config import EngineSettings
from libs.engine.kernels import load as load_kernels
from libs.engine.quant.base import KERNEL_DTYPE, Bf16Linear, WeightOnlyLinear
from libs.engine.quant.blocks import BlockLinear, Blocks, kernel_serves
from libs.engine.quant.int4 import Int4Linear, int4_blocks
from libs.engine.quant.int8 import Int8Linear, int8_blocks
from libs.engine.quant.serve import make_linear

__all__ = [
    "FORMATS",
    "KERNEL_DTYPE",
    "Bf16Linear",
    "BlockLinear",
    "Blocks",
    "Int4Linear",
    "Int8Linear",
    "QuantReport",
    "WeightOnlyLinear",
    "cast_parameters",
    "levels_to_huge_pages",
    "quantize_model",
]


@dataclass(slots=True)
class QuantReport:
    """What :func:`quantize_model` did: the layers it made, per kind."""

    quantization: str
    layers: Counter[str] = field(default_factory=Counter)


# (model, model directory, settings, the CPU kernels when they serve blocks) -> name -> layer
Builder = Callable[[nn.Module, str | Path, EngineSettings, Any], dict[str, WeightOnlyLinear]]


def act_bits(settings: EngineSettings) -> int:
    """The block kernel's activations: 8 for ``engine.quant_activations = "int8"``, else 32."""
    return 8 if settings.quant_activations == "int8" else 32


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _gguf(
    model: nn.Module, model_dir: str | Path, s: EngineSettings, kernels: Any
) -> dict[str, WeightOnlyLinear]:
    from libs.engine.quant.gguf import gguf_linears

    return gguf_linears(model, model_dir, kernels, act_bits(s))


def _int4(
    model: nn.Module, _d: str | Path, s: EngineSettings, kernels: Any
) -> dict[str, WeightOnlyLinear]:
    """Every linear to int4 groups, but the LM head to int8: the vocabulary's logits are the
    most sensitive layer (SmolLM2's perplexity: +6.8% with a 4-bit head, +0.1% with every
    other linear in 4 bits), and vLLM's 4-bit formats leave the head unquantised too."""
    out: dict[str, WeightOnlyLinear] = {}
    for name, m in _linears(model):
        w = m.weight
        blocks = int8_blocks(w) if name.endswith("lm_head") else int4_blocks(w, s.quant_group_size)
        out[name] = make_linear(blocks, m.bias, kernels, w.device, act_bits(s))
    return out


def _int8(
    model: nn.Module, _d: str | Path, s: EngineSettings, kernels: Any
) -> dict[str, WeightOnlyLinear]:
    return {
        n: make_linear(int8_blocks(m.weight), m.bias, kernels, m.weight.device, act_bits(s))
        for n, m in _linears(model)
    }


FORMATS: dict[str, Builder | None] = {
    "none": None,
    "gguf": _gguf,
    "int4": _int4,
    "int8": _int8,
}


@torch.inference_mode()
def quantize_model(
    model: nn.Module, model_dir: str | Path, settings: EngineSettings
) -> QuantReport:
    """Swap ``model``'s linears for ``settings.quantization``'s layers, in place; each is
    built on its weight's device (the CUDA kernels pack differently). A weight another module
    shares (tied embeddings) stays for that module."""
    report = QuantReport(settings.quantization)
    build = FORMATS[settings.quantization]
    if build is None:
        return report
    device = next(model.parameters()).device
    kernels = load_kernels(settings.cpu_kernels, settings.device, "float32")
    if not kernel_serves(kernels, getattr(torch, settings.dtype), device):
        kernels = None
    layers = build(model, model_dir, settings, kernels)
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        report.layers[layer.kind] += 1
    return report


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter outside the quantised layers' weights to ``dtype`` (their biases
    too). Unlike ``model.to(dtype)`` this leaves the layers' bf16 scales and the model's own
    float32 buffers (rotary frequencies) as they are."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)


def levels_to_huge_pages(model: nn.Module) -> None:
    """Every block layer's levels into one arena on huge pages, in the model's order: each
    step streams all of them, as it streams the packed float weights (decision 0008). Called
    by the model runner once the layers are final (after ``engine.fuse_projections``)."""
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    if not layers:
        return
    for layer, view in zip(layers, host_memory.gather([x.qweight for x in layers]), strict=True):
        layer.qweight = view
