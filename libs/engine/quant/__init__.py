"""Weight formats (``engine.quantization``): one module per format behind one interface.

:func:`quantize_model` is called once by :func:`libs.engine.model_runner.load_model`, after
transformers has loaded the float model and before the CPU kernels pack what is left; it
replaces every ``nn.Linear`` with a :class:`~libs.engine.quant.base.WeightOnlyLinear` of the
chosen format and returns a :class:`QuantReport` (logged once at start-up, shown by ``strait
bench engine`` and ``strait models``).

| format | module | kernel (CPU / CUDA) |
| --- | --- | --- |
| ``none`` | — | the model's dtype: Strait's packed fp32 linears, or ``F.linear`` |
| ``gguf`` | :mod:`.gguf` | the source GGUF's blocks: 4-bit types on torch's int4 op, others bf16 |
| ``int4`` | :mod:`.int4` | ``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` (group-wise) |
| ``int8`` | :mod:`.int8` | ``_weight_int8pack_mm`` on both (per output channel) |
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from libs.engine.quant.base import KERNEL_DTYPE, Bf16Linear, WeightOnlyLinear
from libs.engine.quant.int4 import Int4Linear
from libs.engine.quant.int8 import Int8Linear
from libs.settings import EngineSettings

log = logging.getLogger("strait.engine")

__all__ = [
    "FORMATS",
    "KERNEL_DTYPE",
    "Bf16Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantReport",
    "WeightOnlyLinear",
    "cast_parameters",
    "quantize_model",
]


@dataclass(slots=True)
class QuantReport:
    """What :func:`quantize_model` did: layers per kind and bytes of linear weights."""

    quantization: str
    layers: Counter[str] = field(default_factory=Counter)
    weight_bytes: int = 0  # linear weights (and scales) read by one forward

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.layers.items()))
        return f"{self.quantization}: {kinds} ({self.weight_bytes / 2**20:.1f} MiB of linears)"


Builder = Callable[[nn.Module, str | Path, EngineSettings], dict[str, WeightOnlyLinear]]


def _from_float(make: Callable[[nn.Linear], WeightOnlyLinear]) -> Builder:
    def build(
        model: nn.Module, _dir: str | Path, _s: EngineSettings
    ) -> dict[str, WeightOnlyLinear]:
        return {n: make(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    return build


def _gguf(
    model: nn.Module, model_dir: str | Path, _s: EngineSettings
) -> dict[str, WeightOnlyLinear]:
    from libs.engine.quant.gguf import gguf_linears

    return gguf_linears(model, model_dir)


def _int4(model: nn.Module, d: str | Path, s: EngineSettings) -> dict[str, WeightOnlyLinear]:
    group = s.quant_group_size
    return _from_float(lambda m: Int4Linear.from_float(m.weight, group, m.bias))(model, d, s)


FORMATS: dict[str, Builder | None] = {
    "none": None,
    "gguf": _gguf,
    "int4": _int4,
    "int8": _from_float(lambda m: Int8Linear.from_float(m.weight, m.bias)),
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
    layers = build(model, model_dir, settings)
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        report.layers[layer.kind] += 1
        report.weight_bytes += layer.weight_bytes()
    log.info("weights: %s", report.summary())
    return report


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter outside the quantised layers' weights to ``dtype`` (their biases
    too). Unlike ``model.to(dtype)`` this leaves the layers' bf16 scales and the model's own
    float32 buffers (rotary frequencies) as they are."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
