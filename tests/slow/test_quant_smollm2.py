"""Weight formats on SmolLM2-135M-Instruct: served from the GGUF's own blocks.

- with float32 activations (``quant_activations = "float32"``) Strait's block kernel gives the
  float32 model's tokens (the model converted from the same GGUF: its ``generate``);
- with int8 activations (the default) the batched, chunked, preempting engine answers as the
  same format serving one request at a time;
- the layers and bytes are the GGUF's (Q4_1 body, Q8_0 head) and nothing was expanded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine import kernels, quant
from libs.engine.attention import KvCache
from libs.engine.engine import LLMEngine
from libs.engine.loader import ModelShape, load_model
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.slow.test_engine_smollm2 import chat_prompts
from tests.unit.engine.helpers import Submission, reference_greedy, run_engine

pytestmark = pytest.mark.slow

MAX_NEW = 24


def _needs_block_kernel() -> None:
    k = kernels.load("auto", "cpu", "float32")
    if k is None or not k.avx2 or not k.int8_dot:
        pytest.skip("Strait's block kernel with int8 activations needs AVX2 or AVX-512 VNNI")


def _settings(model_dir: Path, **kw: object) -> EngineSettings:
    from transformers import AutoConfig

    shape = ModelShape.of(AutoConfig.from_pretrained(model_dir))
    per_block = KvCache.bytes_per_block(
        shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, torch.float32
    )
    return EngineSettings(
        block_size=16,
        kv_cache_bytes=12 * per_block,  # too few for every prompt at once: preemption
        max_num_batched_tokens=96,
        prefill_chunk_tokens=32,
        max_num_seqs=8,
        quantization="gguf",
        **kw,  # type: ignore[arg-type]
    )


def test_gguf_blocks_with_float_activations_answer_as_the_float_model(smollm2_dir: Path) -> None:
    _needs_block_kernel()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(tokenizer)
    refs = [reference_greedy(ref_model, p, MAX_NEW) for p in prompts]
    del ref_model

    settings = _settings(smollm2_dir, quant_activations="float32")
    model = load_model(smollm2_dir, settings)
    kinds = {m.kind for m in model.modules() if isinstance(m, quant.WeightOnlyLinear)}
    assert kinds == {"gguf-q4_1", "gguf-q8_0"}
    engine = LLMEngine(model, tokenizer, settings, "smollm2-135m-instruct@gguf")
    # ~96 MB of blocks a step, not the float model's 538 MB.
    assert engine.runner.linear_weight_bytes() < 110e6
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    subs = [Submission(f"q{i}", p, greedy, arrive_at_step=i // 3) for i, p in enumerate(prompts)]
    results = run_engine(engine, subs)
    for i in range(len(prompts)):
        assert results[(f"q{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
    assert engine.scheduler.num_preemptions > 0


def test_gguf_with_int8_activations_batched_equals_one_at_a_time(smollm2_dir: Path) -> None:
    _needs_block_kernel()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = chat_prompts(tokenizer)
    base = _settings(smollm2_dir, quant_activations="int8")
    model = load_model(smollm2_dir, base)
    kinds = {m.kind for m in model.modules() if isinstance(m, quant.WeightOnlyLinear)}
    assert kinds == {"gguf-q4_1-a8", "gguf-q8_0-a8"}
    alone = LLMEngine(
        model,
        tokenizer,
        base.model_copy(update={"max_num_seqs": 1, "enable_prefix_caching": False}),
        "smollm2-135m-instruct@gguf+a8",
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    refs = [run_engine(alone, [Submission("a", p, greedy)])[("a", 0)].token_ids for p in prompts]
    del alone
    engine = LLMEngine(model, tokenizer, base, "smollm2-135m-instruct@gguf+a8")
    subs = [Submission(f"q{i}", p, greedy, arrive_at_step=i // 3) for i, p in enumerate(prompts)]
    results = run_engine(engine, subs)
    for i in range(len(prompts)):
        assert results[(f"q{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
    assert engine.scheduler.num_preemptions > 0
    assert sum(results[(f"q{i}", 0)].num_cached_tokens > 0 for i in range(len(prompts))) >= 3
