"""The model a runner serves and what it takes: its weights loaded with Strait's attention in
``engine.dtype`` and ``engine.quantization``'s format (:func:`load_model`), the shape the KV
cache needs (:class:`ModelShape`, also the context a model can serve), and how many KV blocks
fit the budget (:func:`num_kv_blocks`). :class:`~libs.engine.model_runner.ModelRunner` calls
them once at start; benchmarks and tests load models through :func:`load_model` too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from libs.engine import attention, quant
from libs.engine.attention import KvCache
from libs.engine.config import EngineSettings

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the KV cache needs to know about the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    vocab_size: int
    max_position_embeddings: int
    # Keys a sliding-window layer sees (Gemma 3's local layers, Mistral's), 0 when no layer
    # has a window. The paged kernels attend to the whole context, which equals the window's
    # answer only while a sequence fits in the window: see :meth:`context_limit`.
    sliding_window: int = 0

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = c.num_attention_heads
        window = getattr(c, "sliding_window", None) or 0
        layer_types = getattr(c, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            window = 0  # a window in the config that no layer uses
        return cls(
            num_layers=c.num_hidden_layers,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            num_heads=heads,
            vocab_size=c.vocab_size,
            max_position_embeddings=getattr(c, "max_position_embeddings", 0) or 0,
            sliding_window=int(window),
        )

    def context_limit(self, max_model_len: int) -> int:
        """The longest sequence (prompt + output) served: ``max_model_len`` within the model's
        positions and, for a model with sliding-window layers, within the window (beyond it
        those layers would see keys the model never saw together; windowed kernels would lift
        this)."""
        return min(
            max_model_len,
            self.max_position_embeddings or max_model_len,
            self.sliding_window or max_model_len,
        )


def load_model(model_path: str | Path, settings: EngineSettings) -> torch.nn.Module:
    """Load weights from a local directory (or a cached hub id) with our attention selected,
    in ``engine.dtype``, with the linears in ``engine.quantization``'s format."""
    from transformers import AutoModelForCausalLM

    attention.register()
    # Quantised linears are built from float32 weights (GGUF blocks are checked against them).
    load_dtype = DTYPES[settings.dtype] if settings.quantization == "none" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path),
        dtype=load_dtype,
        attn_implementation=attention.ATTENTION_NAME,
        local_files_only=True,
    )
    model.eval()
    model.to(settings.device)  # type: ignore[arg-type]
    if settings.quantization != "none":
        quant.quantize_model(model, model_path, settings)
        quant.cast_parameters(model, DTYPES[settings.dtype])
    return model


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` now (bytes): CUDA's free memory, or the host's available."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(
    settings: EngineSettings, shape: ModelShape, device: torch.device, reserved_bytes: int = 0
) -> int:
    """Blocks that fit the KV budget: ``kv_cache_bytes`` when set, else
    ``kv_cache_memory_fraction`` of free memory; less ``reserved_bytes`` taken from it by
    other tensors of the engine (LoRA adapter slots)."""
    per_block = KvCache.bytes_per_block(
        shape.num_layers,
        settings.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        DTYPES[settings.kv_dtype],
    )
    budget = settings.kv_cache_bytes or int(
        available_memory_bytes(device) * settings.kv_cache_memory_fraction
    )
    return max(0, budget - reserved_bytes) // per_block
