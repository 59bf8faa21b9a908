"""Weight formats (``engine.quantization``, libs/engine/quant) on tiny random models.

- each layer computes what its stored numbers say (int4, int8, GGUF blocks decoded exactly as
  the ``gguf`` package dequantises them, the llama Q/K row order undone);
- within a format, serving never changes the answer: greedy output of the batched, chunked,
  preempting, prefix-hitting engine equals ``model.generate`` of the same quantised model;
- a GGUF that does not match its converted directory is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.support.tiny_models import tiny_model
from libs.engine import quant
from libs.engine.engine import LLMEngine
from libs.engine.quant.gguf import DECODED, EXACT, decode_blocks, gguf_tensor_name
from libs.protocol import SamplingParams
from libs.settings import EngineSettings, Settings, model_identity
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine
from tests.unit.engine.test_invariance import prompts

pytestmark = pytest.mark.unit

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


def _cpu_has(flag: str) -> bool:
    """Whether this CPU reports ``flag`` in /proc/cpuinfo (False where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def _kernels():  # type: ignore[no-untyped-def]
    from libs.engine import kernels

    k = kernels.load("auto", "cpu", "float32")
    if k is None or not k.avx2:
        if os.environ.get("CI") == "true" and k is None:
            pytest.fail("the CPU kernels did not build")
        pytest.skip("Strait's block kernel needs AVX2")
    return k


@pytest.mark.parametrize(("bits", "offsets"), [(4, True), (4, False), (8, False)])
def test_block_kernel_gives_the_float_kernels_bits(bits: int, offsets: bool) -> None:
    """Served from its levels, a block-quantized linear computes exactly what the float32
    packed kernel computes over the dequantised weights, at every row count."""
    k = _kernels()
    torch.manual_seed(0)
    n, kk, group = 100, 96, 32  # 100 outputs: a partial last panel
    q = torch.randint(0, 16, (n, kk)) if bits == 4 else torch.randint(-128, 128, (n, kk))
    d = quant.blocks.fp16_exact(torch.rand(n, kk // group) * 0.05 + 1e-3)
    m = quant.blocks.fp16_exact(torch.randn(n, kk // group) * 0.1) if offsets else None
    blocks = quant.Blocks(q, d, m, bits, group)
    bias = torch.randn(n)
    layer = quant.BlockLinear(blocks, bias, k)
    packed = k.pack_weight(blocks.dequantized())
    for rows in (1, 2, 5, 12, 13, 32):
        x = torch.randn(rows, kk)
        assert torch.equal(layer(x), k.packed_linear(x, packed, n, bias)), rows
    # torch's kernels for the same blocks (CUDA, no AVX2): bf16 activations, close.
    fallback = quant.serve.make_linear(blocks, bias, None, torch.device("cpu"))
    x = torch.randn(7, kk)
    ref = x @ blocks.dequantized().t() + bias
    assert torch.allclose(fallback(x), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def _int8_activation_reference(x: torch.Tensor, blocks: quant.Blocks) -> torch.Tensor:
    """What the int8-activation path computes, in float64: x rounded per 32 inputs to
    absmax / 127 levels, times the exact weights."""
    r, kk = x.shape
    xb = x.view(r, kk // 32, 32)
    xd = xb.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(xd > 0, torch.round(xb / xd), torch.zeros_like(xb)) * xd
    return xq.view(r, kk).double() @ blocks.dequantized().double().t()


@pytest.mark.parametrize(("bits", "offsets"), [(4, True), (4, False), (8, False)])
def test_block_kernel_with_int8_activations_is_llama_cpps_arithmetic(
    bits: int, offsets: bool
) -> None:
    """Integer dot products of levels and int8 activation blocks: equal (to float32 rounding)
    to the float64 product of the rounded activations and the exact weights; and a row's
    result does not depend on the other rows of its batch."""
    k = _kernels()
    if not k.int8_dot:
        pytest.skip("int8 activations need AVX-512 VNNI or AVX2 (an AVX-512 CPU without VNNI)")
    torch.manual_seed(1)
    n, kk, group = 100, 128, 64 if bits == 4 else 128
    q = torch.randint(0, 16, (n, kk)) if bits == 4 else torch.randint(-128, 128, (n, kk))
    d = quant.blocks.fp16_exact(torch.rand(n, kk // group) * 0.05 + 1e-3)
    m = quant.blocks.fp16_exact(torch.randn(n, kk // group) * 0.1) if offsets else None
    blocks = quant.Blocks(q, d, m, bits, group)
    bias = torch.randn(n)
    layer = quant.BlockLinear(blocks, bias, k, act_bits=8)
    x = torch.randn(32, kk)
    x[3, :32] = 0.0  # an all-zero block
    y = layer(x)
    ref = _int8_activation_reference(x, blocks) + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 5, 9):
        assert torch.equal(layer(x[:rows]), y[:rows]), rows


def test_int4_and_int8_quantisers_stay_within_half_a_level() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    for group in (32, 64):
        b = quant.int4.int4_blocks(w, group)
        assert b.q.min() >= 0 and b.q.max() <= 15
        err = (b.dequantized() - w).abs().view(96, -1, group).amax(-1)
        assert (err <= b.d * 0.51 + 1e-6).all()
    b8 = quant.int8.int8_blocks(w)
    assert b8.group == 128 and b8.d.shape == (96, 1)
    inside = w.abs() <= 127 * b8.d  # not clipped by the clip search
    assert ((b8.dequantized() - w).abs()[inside] <= (b8.d.expand_as(w) * 0.51)[inside]).all()


def _random_q4k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks (the gguf package cannot quantise to Q4_K) with finite d, dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(rows, cols // 256)).astype(np.float16)
    raw[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    raw[..., 2:4] = (d / 2)[..., None].view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", DECODED)
def test_gguf_blocks_decode_as_the_gguf_package_dequantises(kind: str) -> None:
    rows, cols = 16, 512
    if kind == "Q4_K":
        raw = _random_q4k(rows, cols)
    else:
        raw = quantize(np.random.default_rng(1).standard_normal((rows, cols), np.float32), T[kind])
    blocks = decode_blocks(kind, raw, cols)
    theirs = torch.from_numpy(dequantize(raw, T[kind]).astype(np.float32))
    if kind in EXACT:  # the same roundings in the same order: the same bits
        assert torch.equal(blocks.dequantized(), theirs)
    else:
        assert torch.allclose(blocks.dequantized(), theirs, rtol=1e-6, atol=1e-7)


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
    torch_kernels = EngineSettings(quantization="gguf", cpu_kernels="off")
    report = quant.quantize_model(served, tmp_path / "tiny", torch_kernels)
    assert report.layers == {"gguf-q4_1-torch": 15}  # 2 layers × 7 + lm_head
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


def serve_staggered(
    model: torch.nn.Module, refs: list[list[int]], num_blocks: int = 20, **engine: object
) -> tuple[LLMEngine, dict]:
    """``prompts()`` through one engine, one arriving every other step, under a KV budget of
    ``num_blocks`` float32 blocks (preemption) and 8-token chunks; asserts every greedy answer
    equals ``refs`` and that a preemption happened. Returns the engine and its results."""
    settings = engine_settings(
        model,
        num_blocks=num_blocks,
        block_size=4,
        prefill_chunk_tokens=8,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        **engine,
    )
    eng = LLMEngine(model, None, settings, "tiny")
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ps = prompts()
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(eng, subs)
    for i in range(len(ps)):
        assert results[(f"r{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
    assert eng.scheduler.num_preemptions > 0
    assert eng.pool.num_used == 0  # every block returned
    return eng, results


MAX_NEW = 10


@pytest.mark.parametrize(
    ("arch", "quantization", "cpu_kernels", "acts"),
    [
        ("llama", "gguf", "on", "int8"),
        ("llama", "gguf", "off", "int8"),  # torch's kernels: bf16 activations
        ("llama", "int4", "on", "int8"),
        ("qwen2", "int4", "on", "float32"),  # biased projections
        ("llama", "int8", "on", "int8"),
        ("mistral", "int8", "on", "float32"),
        ("qwen2", "int8", "off", "int8"),
    ],
)
def test_greedy_within_a_format_matches_generate_of_that_format(
    arch: str, quantization: str, cpu_kernels: str, acts: str, tmp_path: Path
) -> None:
    model = tiny_model(arch)
    if quantization == "gguf":
        write_tiny_gguf(model, tmp_path / "tiny")
    fmt = EngineSettings(quantization=quantization, cpu_kernels=cpu_kernels, quant_activations=acts)
    quant.quantize_model(model, tmp_path / "tiny", fmt)
    refs = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    _, results = serve_staggered(
        model, refs, cpu_kernels=cpu_kernels, quantization=quantization, quant_activations=acts
    )
    assert any(r.num_cached_tokens > 0 for r in results.values())


def test_the_weights_format_is_part_of_the_model_identity() -> None:
    name = "smollm2-135m-instruct"
    assert model_identity(name, EngineSettings()) == name
    assert model_identity(name, EngineSettings(quantization="gguf")) == f"{name}@gguf+a8"
    exact = EngineSettings(quantization="gguf", quant_activations="float32")
    assert model_identity(name, exact) == f"{name}@gguf"
    assert (
        model_identity(
            name,
            EngineSettings(
                quantization="int4",
                quant_group_size=64,
                dtype="bfloat16",
                quant_activations="float32",
            ),
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
        pytest.param(
            "bfloat16",
            "auto",
            "none",
            "off",
            # Known: on a CPU with AVX512-BF16 (where torch's bf16 kernels use those
            # instructions) bf16 activations are not batch-invariant: prompt 7 of ten diverges
            # at its 4th token; on an AVX2-only CPU they are. Cause not found (bf16 F.linear
            # rows measured batch-independent at these shapes; attention runs in float32).
            # Strict: the fix turns this red, so the mark comes off with it.
            marks=pytest.mark.xfail(
                _cpu_has("avx512_bf16"),
                strict=True,
                raises=AssertionError,
                reason="bf16 torch path not batch-invariant with AVX512-BF16",
            ),
        ),
        ("bfloat16", "auto", "int8", "off"),
    ],
)
def test_narrow_kv_and_bf16_activations_batched_equal_one_at_a_time(
    dtype: str, kv_cache_dtype: str, quantization: str, cpu_kernels: str
) -> None:
    """Where no float32 reference exists (bf16 activations, a narrower KV cache), the batched,
    chunked, preempting engine answers as the same format serving one request at a time."""
    model = tiny_model("llama")
    fmt = EngineSettings(
        quantization=quantization,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        cpu_kernels=cpu_kernels,
    )
    quant.quantize_model(model, "", fmt)
    if dtype != "float32":
        quant.cast_parameters(model, torch.bfloat16)
    common: dict = dict(
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
            model,
            num_blocks=64,
            block_size=4,
            max_num_seqs=1,
            enable_prefix_caching=False,
            **common,
        ),
        "tiny",
    )
    assert alone.runner.kv_cache.data.dtype == getattr(torch, fmt.kv_dtype)
    refs = [run_engine(alone, [Submission("a", p, greedy)])[("a", 0)].token_ids for p in prompts()]
    # kv_bytes counts float32 blocks: 20 blocks of the narrower cache.
    serve_staggered(
        model, refs, num_blocks=20 * getattr(torch, fmt.kv_dtype).itemsize // 4, **common
    )


def test_gguf_on_the_block_kernel_answers_as_the_float_model(tmp_path: Path) -> None:
    """Served from its Q4_1 blocks by Strait's kernel, a model gives the tokens of the float32
    model converted from the same GGUF (its ``generate``), batched, chunked and preempted."""
    _kernels()
    model = tiny_model("llama")
    write_tiny_gguf(model, tmp_path / "tiny")  # model now holds the dequantised weights
    refs = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    fmt = EngineSettings(quantization="gguf", cpu_kernels="on", quant_activations="float32")
    report = quant.quantize_model(model, tmp_path / "tiny", fmt)
    assert report.layers == {"gguf-q4_1": 15}
    serve_staggered(model, refs, cpu_kernels="on", quantization="gguf", quant_activations="float32")
