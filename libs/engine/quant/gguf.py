"""A GGUF's quantized linear weights, served from their blocks.

:func:`gguf_linears` is called by :func:`libs.engine.quant.quantize_model` for
``engine.quantization = "gguf"``: the model's float weights (norms, embeddings) come from the
directory converted from the GGUF (``libs.models.convert``, whose marker names the source file),
and every linear is rebuilt from the GGUF's own tensor:

- Q4_0, Q4_1 and Q8_0 (fp16 scales and offsets per 32 inputs) are served as stored by
  Strait's kernel where it runs (:class:`~libs.engine.quant.blocks.BlockLinear`: the float32
  model's own numbers), else by torch's int4 / int8 kernels (bf16 activations);
- Q4_K (``q * d * sc - dmin * mn`` per 32 of a 256-superblock) by torch's int4 kernel:
  scale ``d * sc``, zero ``8 * d * sc - dmin * mn``, rounded to bf16;
- any other block type (Q6_K, Q5_*...) has no maintained kernel for its group-wise
  scales: it is dequantised with the ``gguf`` package and re-quantised to int8 with one scale
  per row (:class:`~libs.engine.quant.int8.Int8Linear`; bf16 through ``F.linear`` read the
  49152-row lm_head ~10x slower at one row on this CPU).

Every rebuilt weight is checked against the converted float weight before it replaces it
(the file and the directory must hold the same model, and the name map must be right).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from libs.engine.converted import source_gguf
from libs.engine.quant.base import WeightOnlyLinear
from libs.engine.quant.blocks import BlockLinear, Blocks
from libs.engine.quant.int8 import Int8Linear
from libs.engine.quant.serve import make_linear

# HF module name suffix -> llama.cpp tensor name (llama, mistral, qwen2, gemma3 share them).
LAYER_NAMES = {
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


def gguf_tensor_name(module_name: str) -> str | None:
    """The GGUF tensor holding the weight of HF linear ``module_name``, or None."""
    if module_name.endswith("lm_head"):
        return "output.weight"
    m = _LAYER_RE.search(module_name)
    if m is None or m.group(2) not in LAYER_NAMES:
        return None
    return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian fp16 from ``[..., 2]`` uint8 → float32 tensor ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes → ``[..., 32]`` levels: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# Block types whose scales (and offsets) are fp16 values: served exactly by Strait's kernel.
EXACT = ("Q4_0", "Q4_1", "Q8_0")
DECODED = (*EXACT, "Q4_K")


def decode_blocks(kind: str, raw: np.ndarray, in_features: int) -> Blocks:
    """``raw [out, bytes per row]`` of a GGUF block type → :class:`Blocks` (same numbers)."""
    out = raw.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = raw.reshape(out, in_features // 32, size)
        d = _f16(b[..., 0:2])
        m = _f16(b[..., 2:4]) if kind == "Q4_1" else None  # Q4_0: (q - 8) * d
        q = torch.from_numpy(_nibbles(b[..., size - 16 : size]).reshape(out, in_features))
        return Blocks(q, d, m, 4, 32)
    if kind == "Q8_0":
        b = raw.reshape(out, in_features // 32, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(out, -1))
        return Blocks(q, _f16(b[..., 0:2]), None, 8, 32)
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
        offset = -(dmin * torch.from_numpy(mn.astype(np.float32)))
        q = torch.from_numpy(np.ascontiguousarray(levels))
        return Blocks(q, scale.reshape(out, -1), offset.reshape(out, -1), 4, 32)
    raise ValueError(f"no decoder for GGUF block type {kind}")


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

    def linear(
        self,
        name: str,
        module_name: str,
        config: Any,
        bias: torch.Tensor | None,
        device: torch.device,
        kernels: Any | None,
        act_bits: int = 32,
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
        if kind in DECODED:
            blocks = decode_blocks(kind, raw, in_features)
            if order is not None:
                m = None if blocks.m is None else blocks.m[order]
                blocks = Blocks(blocks.q[order], blocks.d[order], m, blocks.bits, blocks.group)
            # Q4_K's scales (d × a 6-bit factor) are not fp16 values: torch's int4 kernel.
            layer = make_linear(blocks, bias, kernels if kind in EXACT else None, device, act_bits)
            if isinstance(layer, BlockLinear):
                layer.kind = f"gguf-{kind.lower()}" + ("-a8" if layer.act_bits == 8 else "")
            else:
                layer.kind = f"gguf-{kind.lower()}-torch"
            return layer, blocks.dequantized()
        w = torch.from_numpy(np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32))
        w = w.reshape(out_features, in_features)
        if order is not None:
            w = w[order]
        layer = Int8Linear.from_float(w.to(device), bias)
        layer.kind = f"gguf-{kind.lower()}-int8"
        return layer, w


def gguf_linears(
    model: nn.Module, model_dir: str | Path, kernels: Any | None = None, act_bits: int = 32
) -> dict[str, WeightOnlyLinear]:
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
        layer, ref = weights.linear(
            name, module_name, config, module.bias, module.weight.device, kernels, act_bits
        )
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
