"""Weight formats (``engine.quantization``, libs/engine/quant) on tiny random models.

- each layer computes what its stored numbers say (int4, int8, GGUF blocks decoded exactly as
  the ``gguf`` package dequantises them, the llama Q/K row order undone);
- within a format, serving never changes the answer: greedy output of the batched, chunked,
  preempting, prefix-hitting engine equals ``model.generate`` of the same quantised model;
- a GGUF that does not match its converted directory is refused.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from libs.engine import quant
from libs.engine.engine import LLMEngine
from libs.engine.quant.gguf import FOUR_BIT, decode_4bit, gguf_tensor_name
from libs.protocol import SamplingParams
from libs.settings import EngineSettings, Settings, model_identity
from tests.unit.engine.helpers import (
    TINY_VOCAB,
    Submission,
    engine_settings,
    reference_greedy,
    run_engine,
    tiny_model,
)

pytestmark = pytest.mark.unit

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


def _dequant_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    out, n = q.shape
    g = n // scale.shape[1]
    w = (q.float() - 8).view(out, -1, g) * scale[..., None] + zero[..., None]
    return w.view(out, n)


def test_int4_and_int8_layers_compute_their_stored_weights() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    x = torch.randn(5, 128)
    for group in (32, 64):
        layer = quant.Int4Linear.from_float(w, group)
        sz = layer.scales_zeros.float()  # [in / group, out, 2]
        # Reconstruct q from the float weights the same way, then compare the layer's output
        # with x_bf16 @ dequantised weights (the kernel's own rounding: bf16 output).
        scale, zero = sz[..., 0].t(), sz[..., 1].t()
        q = torch.round((w.view(96, -1, group) - (zero - 8 * scale)[..., None]) / scale[..., None])
        deq = _dequant_int4(q.clamp(0, 15).view(96, 128), scale, zero)
        assert (deq - w).abs().max() <= scale.max() * 0.51  # within half a level
        ref = x.bfloat16().float() @ deq.t()
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (5, 96)
        assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    layer8 = quant.Int8Linear.from_float(w)
    deq8 = layer8.q.float() * layer8.scale.float()[:, None]
    assert (deq8 - w).abs().max() <= layer8.scale.float().max() * 0.51
    ref8 = x.bfloat16().float() @ deq8.t()
    assert torch.allclose(layer8(x), ref8, rtol=2e-2, atol=2e-2 * ref8.abs().max().item())


def _random_q4k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks (the gguf package cannot quantise to Q4_K) with finite d, dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(rows, cols // 256)).astype(np.float16)
    raw[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    raw[..., 2:4] = (d / 2)[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", FOUR_BIT)
def test_gguf_4bit_blocks_decode_exactly_as_the_gguf_package(kind: str) -> None:
    rows, cols = 16, 512
    if kind == "Q4_K":
        raw = _random_q4k(rows, cols)
    else:
        raw = quantize(np.random.default_rng(1).standard_normal((rows, cols), np.float32), T[kind])
    q, scale, zero = decode_4bit(kind, raw, cols)
    assert q.shape == (rows, cols) and int(q.min()) >= 0 and int(q.max()) <= 15
    ours = _dequant_int4(q, scale, zero)
    theirs = torch.from_numpy(dequantize(raw, T[kind]).astype(np.float32))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ a tiny GGUF


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (the inverse of what the loader undoes)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(model: torch.nn.Module, model_dir: Path, kind: str = "Q4_1") -> Path:
    """Quantise every linear of ``model`` to ``kind`` blocks, write them to a GGUF in llama.cpp's
    naming and row order, put the dequantised weights back into ``model`` and save it to
    ``model_dir`` with the converter's marker naming the GGUF: what ``strait models prepare``
    leaves behind for a GGUF model."""
    cfg = model.config
    path = model_dir.parent / f"{model_dir.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            w = module.weight.detach().float().numpy()
            raw = quantize(w, T[kind])
            module.weight.copy_(torch.from_numpy(dequantize(raw, T[kind])))
            heads = cfg.num_attention_heads if name.endswith("q_proj") else cfg.num_key_value_heads
            if name.endswith(("q_proj", "k_proj")):
                raw = _llama_cpp_permute(raw, heads)
            tensor = gguf_tensor_name(name)
            assert tensor is not None
            writer.add_tensor(tensor, raw, raw_shape=raw.shape, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(model_dir)
    (model_dir / ".strait-converted").write_text(f"source={path}\n")
    return path


def test_gguf_layers_match_the_converted_model_and_a_foreign_file_is_refused(
    tmp_path: Path,
) -> None:
    model = tiny_model("llama")
    write_tiny_gguf(model, tmp_path / "tiny")
    ids = torch.tensor([[5, 17, 3, 200, 9]])
    with torch.inference_mode():
        ref = model(ids).logits
    served = tiny_model("llama")
    served.load_state_dict(model.state_dict())
    report = quant.quantize_model(served, tmp_path / "tiny", EngineSettings(quantization="gguf"))
    assert report.layers == {"gguf-q4_1": 15}  # 2 layers × 7 + lm_head
    with torch.inference_mode():
        out = served(ids).logits
    # bf16 activations around exact 4-bit weights: close to the float model, not equal.
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))

    other = tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="different models"):
        quant.quantize_model(other, tmp_path / "tiny", EngineSettings(quantization="gguf"))
    with pytest.raises(ValueError, match="no source GGUF"):
        quant.quantize_model(tiny_model("llama"), tmp_path, EngineSettings(quantization="gguf"))


# ------------------------------------------------------------------ invariance per format

MAX_NEW = 10


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    out = []
    for i, n in enumerate([3, 9, 17, 30, 5, 41, 12, 1]):
        tail = [rng.randrange(TINY_VOCAB) for _ in range(n)]
        out.append(system + tail if i % 4 < 2 else tail)
    return out


@pytest.mark.parametrize(
    ("arch", "quantization", "cpu_kernels"),
    [
        ("llama", "gguf", "on"),
        ("llama", "gguf", "off"),
        ("llama", "int4", "on"),
        ("qwen2", "int4", "on"),  # biased projections
        ("llama", "int8", "on"),
        ("qwen2", "int8", "off"),
    ],
)
def test_greedy_within_a_format_matches_generate_of_that_format(
    arch: str, quantization: str, cpu_kernels: str, tmp_path: Path
) -> None:
    model = tiny_model(arch)
    if quantization == "gguf":
        write_tiny_gguf(model, tmp_path / "tiny")
    quant.quantize_model(model, tmp_path / "tiny", EngineSettings(quantization=quantization))
    ps = prompts()
    refs = [reference_greedy(model, p, MAX_NEW) for p in ps]
    settings = engine_settings(
        model,
        num_blocks=20,
        block_size=4,
        prefill_chunk_tokens=8,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        cpu_kernels=cpu_kernels,
        quantization=quantization,
    )
    engine = LLMEngine(model, None, settings, "tiny")
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(engine, subs)
    for i in range(len(ps)):
        assert results[(f"r{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
    assert engine.scheduler.num_preemptions > 0
    assert any(results[(f"r{i}", 0)].num_cached_tokens > 0 for i in range(len(ps)))
    assert engine.pool.num_used == 0


def test_the_weights_format_is_part_of_the_model_identity() -> None:
    name = "smollm2-135m-instruct"
    assert model_identity(name, EngineSettings()) == name
    assert model_identity(name, EngineSettings(quantization="gguf")) == f"{name}@gguf"
    assert (
        model_identity(
            name, EngineSettings(quantization="int4", quant_group_size=64, dtype="bfloat16")
        )
        == f"{name}@int4-g64+bfloat16"
    )
    assert model_identity(name, EngineSettings(kv_cache_dtype="bfloat16")) == f"{name}@kv-bfloat16"
    # A pool's own format overrides the engine's.
    s = Settings(pools=[{"name": "q", "quantization": "int8"}], engine={"quantization": "gguf"})
    assert s.engine_for(s.pools[0]).quantization == "int8"
    assert s.engine.quantization == "gguf"


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "quantization", "cpu_kernels"),
    [
        ("float32", "bfloat16", "none", "on"),  # kernels' linears, torch's attention
        ("float32", "float16", "int4", "off"),
        ("bfloat16", "auto", "none", "off"),
        ("bfloat16", "auto", "int8", "off"),
    ],
)
def test_narrow_kv_and_bf16_activations_batched_equal_one_at_a_time(
    dtype: str, kv_cache_dtype: str, quantization: str, cpu_kernels: str
) -> None:
    """Where no float32 reference exists (bf16 activations, a narrower KV cache), the batched,
    chunked, preempting engine answers as the same format serving one request at a time."""
    model = tiny_model("llama")
    fmt = EngineSettings(quantization=quantization, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    quant.quantize_model(model, "", fmt)
    if dtype != "float32":
        quant.cast_parameters(model, torch.bfloat16)
    ps = prompts()
    common: dict = dict(
        block_size=4,
        prefill_chunk_tokens=8,
        cpu_kernels=cpu_kernels,
        quantization=quantization,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    alone = LLMEngine(
        model,
        None,
        engine_settings(
            model, num_blocks=64, max_num_seqs=1, enable_prefix_caching=False, **common
        ),
        "tiny",
    )
    assert alone.runner.kv_cache.data.dtype == getattr(torch, fmt.kv_dtype)
    refs = [run_engine(alone, [Submission("a", p, greedy)])[("a", 0)].token_ids for p in ps]
    batched = LLMEngine(
        model,
        None,
        # kv_bytes counts float32 blocks: 20 blocks of the narrower cache.
        engine_settings(
            model,
            num_blocks=20 * getattr(torch, fmt.kv_dtype).itemsize // 4,
            max_num_batched_tokens=24,
            max_num_seqs=6,
            **common,
        ),
        "tiny",
    )
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(batched, subs)
    for i in range(len(ps)):
        assert results[(f"r{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
    assert batched.scheduler.num_preemptions > 0
    assert batched.pool.num_used == 0
