"""The engine's contract on SmolLM2-135M-Instruct: greedy fp32 output equals transformers'
``generate`` whatever the batching, chunking, prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine.attention import KvCache
from libs.engine.engine import LLMEngine
from libs.engine.loader import ModelShape
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.unit.engine.helpers import Submission, reference_greedy, run_engine

pytestmark = pytest.mark.slow

MAX_NEW = 24
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about rivers.",
    "What is 12 times 7?",
    "Translate 'good morning' to Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "中文怎么说“谢谢”？",
]


def chat_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        if i % 3 != 2:  # most share the system prompt → prefix-cache hits
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def test_greedy_matches_generate_on_smollm2(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(tokenizer)
    refs = [reference_greedy(model, p, MAX_NEW) for p in prompts]

    shape = ModelShape.of(model.config)
    per_block = KvCache.bytes_per_block(
        shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, torch.float32
    )
    # 12 blocks of 16 tokens: far fewer than 9 prompts of ~40-60 tokens + 24 new need at once
    # → admission waits and running sequences get preempted when they grow.
    settings = EngineSettings(
        block_size=16,
        kv_cache_bytes=12 * per_block,
        max_num_batched_tokens=96,
        prefill_chunk_tokens=32,  # splits every prompt
        max_num_seqs=8,
    )
    engine = LLMEngine(model, tokenizer, settings, "smollm2-135m-instruct")
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)  # stops at EOS, as generate
    subs = [Submission(f"q{i}", p, greedy, arrive_at_step=i // 3) for i, p in enumerate(prompts)]
    results = run_engine(engine, subs)
    for i in range(len(prompts)):
        r = results[(f"q{i}", 0)]
        assert r.token_ids == refs[i], f"prompt {i} diverged"
        assert r.text == tokenizer.decode(refs[i], skip_special_tokens=True)
    assert engine.scheduler.num_preemptions > 0
    assert sum(results[(f"q{i}", 0)].num_cached_tokens > 0 for i in range(len(prompts))) >= 3

    # Seeded n=2 sampling: the same choices alone and in a crowd.
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99, n=2)
    alone = run_engine(engine, [Submission("s", prompts[3], seeded)])
    crowd = run_engine(
        engine,
        [Submission(f"c{i}", p, greedy, arrive_at_step=0) for i, p in enumerate(prompts[:5])]
        + [Submission("s", prompts[3], seeded, arrive_at_step=2)],
    )
    for i in (0, 1):
        assert crowd[("s", i)].token_ids == alone[("s", i)].token_ids
