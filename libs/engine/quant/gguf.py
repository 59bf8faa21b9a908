"""A GGUF's quantized linear weights, served from their blocks.

:func:`gguf_linears` is called by :func:`libs.engine.quant.quantize_model` for
``engine.quantization = "gguf"``: the model's float weights (norms, embeddings) come from the
directory converted from the GGUF (``libs.models.convert``, whose marker names the source file),
and every linear is rebuilt from the GGUF's own tensor:

- 4-bit blocks map exactly onto torch's int4 kernel, ``w = (q - 8) * scale + zero`` per group
  of 32 (:class:`~libs.engine.quant.int4.Int4Linear`); only scale and zero are rounded to bf16:
  Q4_0 ``(q - 8) * d``: scale ``d``, zero 0; Q4_1 ``q * d + m``: scale ``d``, zero ``m + 8d``;
  Q4_K ``q * d * sc - dmin * mn`` per 32 of a 256-superblock: scale ``d * sc``, zero
  ``8 * d * sc - dmin * mn``;
- any other block type (Q8_0, Q6_K, Q5_*...) has no maintained kernel for its group-wise
  scales: it is dequantised with the ``gguf`` package and re-quantised to int8 with one scale
  per row (:class:`~libs.engine.quant.int8.Int8Linear`; bf16 through ``F.linear`` read the
  49152-row lm_head ~10x slower at one row on this CPU).

Every rebuilt weight is checked against the converted float weight before it replaces it
(the file and the directory must hold the same model, and the name map must be right).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from libs.engine.quant.base import WeightOnlyLinear
from libs.engine.quant.int4 import Int4Linear
from libs.engine.quant.int8 import Int8Linear

log = logging.getLogger("strait.engine")

# HF module name suffix -> llama.cpp tensor name (llama, mistral, qwen2, gemma3 share them).
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
# Largest |dequantised - converted| allowed, relative to the tensor's largest magnitude
# (both sides compute q * d + m in float32; only the order of operations may differ).
_MATCH_RTOL = 1e-5


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from (its marker's ``source=``), or None."""
    marker = Path(model_dir) / ".strait-converted"
    if not marker.exists():
        return None
    for line in marker.read_text().splitlines():
        if line.startswith("source="):
            path = Path(line.removeprefix("source="))
            return path if path.is_file() else None
    return None


def gguf_tensor_name(module_name: str) -> str | None:
    """The GGUF tensor holding the weight of HF linear ``module_name``, or None."""
    if module_name.endswith("lm_head"):
        return "output.weight"
    m = _LAYER_RE.search(module_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 from ``[..., 2]`` uint8 → float32 tensor ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes → ``[..., 32]`` levels: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_4bit(kind: str, raw: np.ndarray, in_features: int) -> tuple[Any, Any, Any]:
    """``raw [out, bytes per row]`` of a 4-bit type → (q ``[out, in]`` 0..15, scale, zero
    ``[out, in / 32]`` float32) with ``w = (q - 8) * scale + zero``."""
    out = raw.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = raw.reshape(out, in_features // 32, size)
        d = _f16(b[..., 0:2])
        if kind == "Q4_0":
            zero = torch.zeros_like(d)
            qs = b[..., 2:18]
        else:
            zero = _f16(b[..., 2:4]) + 8 * d
            qs = b[..., 4:20]
        q = torch.from_numpy(_nibbles(qs).reshape(out, in_features))
        return q, d, zero
    if kind == "Q4_K":
        b = raw.reshape(out, in_features // 256, 144)
        d = _f16(b[..., 0:2])[..., None]  # [out, S, 1]
        dmin = _f16(b[..., 2:4])[..., None]
        s = b[..., 4:16].astype(np.int32)  # [out, S, 12]: 6-bit scale and min of 8 sub-blocks
        sc = np.concatenate(
            [s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1
        )
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., 16:144].reshape(out, in_features // 256, 4, 32)
        # Chunk c of 64 elements: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
        levels = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(out, in_features)
        scale = d * torch.from_numpy(sc.astype(np.float32))  # [out, S, 8]
        zero = 8 * scale - dmin * torch.from_numpy(mn.astype(np.float32))
        return (
            torch.from_numpy(np.ascontiguousarray(levels)),
            scale.reshape(out, -1),
            zero.reshape(out, -1),
        )
    raise ValueError(f"not a 4-bit block type: {kind}")


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def _rope_unpermute(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K permutation for rotary embeddings (llama arch):
    HF row ``n*d + t*d/2 + j`` is GGUF row ``n*d + 2j + t`` (``d`` the head's rows)."""
    d = n_rows // n_head
    h = torch.arange(n_rows)
    n, r = h // d, h % d
    t, j = r // (d // 2), r % (d // 2)
    return n * d + 2 * j + t


class GgufWeights:
    """An open GGUF file: tensors by name, its architecture, head counts for the Q/K order."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch_field = self.reader.fields["general.architecture"]
        self.arch = bytes(arch_field.parts[arch_field.data[0]]).decode()

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def linear(
        self,
        name: str,
        module_name: str,
        config: Any,
        bias: torch.Tensor | None,
        device: torch.device,
    ) -> tuple[WeightOnlyLinear, torch.Tensor]:
        """The layer for GGUF tensor ``name`` (HF linear ``module_name``), in HF's row order,
        and the float32 weight the file's blocks hold (before any bf16 rounding), on the CPU."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        kind = t.tensor_type.name
        in_features, out_features = (int(x) for x in t.shape[:2])
        order = None
        if self.arch == "llama" and module_name.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads
            if module_name.endswith("k_proj"):
                heads = getattr(config, "num_key_value_heads", None) or heads
            order = _rope_unpermute(out_features, heads)
        raw = np.asarray(t.data).reshape(out_features, -1)
        if kind in FOUR_BIT:
            q, scale, zero = decode_4bit(kind, raw, in_features)
            if order is not None:
                q, scale, zero = q[order], scale[order], zero[order]
            layer: WeightOnlyLinear = Int4Linear(
                q.to(device), scale.to(device), zero.to(device), 32, bias
            )
            layer.kind = f"gguf-{kind.lower()}"
            ref = (q.float() - 8).view(out_features, -1, 32) * scale[..., None] + zero[..., None]
            return layer, ref.flatten(1)
        w = torch.from_numpy(np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32))
        w = w.reshape(out_features, in_features)
        if order is not None:
            w = w[order]
        layer = Int8Linear.from_float(w.to(device), bias)
        layer.kind = f"gguf-{kind.lower()}-int8"
        return layer, w


def gguf_linears(model: nn.Module, model_dir: str | Path) -> dict[str, WeightOnlyLinear]:
    """A :class:`WeightOnlyLinear` from the source GGUF for every linear of ``model`` (name →
    layer); raises when the directory was not converted from a GGUF, or a tensor is missing or
    does not match the converted weight."""
    path = source_gguf(model_dir)
    if path is None:
        raise ValueError(
            f"engine.quantization=gguf needs a model converted from a GGUF file; {model_dir} "
            "has no source GGUF (convert it with `strait models prepare` or pick int4 / int8)"
        )
    weights = GgufWeights(path)
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers: dict[str, WeightOnlyLinear] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = gguf_tensor_name(module_name)
        if name is not None and name not in weights.tensors and module_name.endswith("lm_head"):
            name = "token_embd.weight"  # tied embeddings: the GGUF holds one copy
        if name is None or name not in weights.tensors:
            raise ValueError(f"{path.name} holds no tensor for {module_name} (looked for {name})")
        layer, ref = weights.linear(name, module_name, config, module.bias, module.weight.device)
        w = module.weight.detach().float().cpu()
        if ref.shape != w.shape:
            raise ValueError(f"{name} is {tuple(ref.shape)}, {module_name} is {tuple(w.shape)}")
        err = (ref - w).abs().max().item()
        if err > _MATCH_RTOL * max(w.abs().max().item(), 1e-12):
            raise ValueError(
                f"{name} in {path.name} does not match the converted {module_name} "
                f"(max |diff| {err:.3g}): the directory and the GGUF are different models"
            )
        layers[module_name] = layer
    return layers
