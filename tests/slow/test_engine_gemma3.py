"""The engine on Gemma 3 270M (the two-pool config's large model): greedy float32 output equals
transformers' ``generate`` in a chunked, batched run through Gemma's turn template, and the
context stops at the sliding window (the paged kernels attend to the whole context)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.backend import BackendError
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import EngineSettings, Settings
from tests.unit.engine.helpers import Submission, reference_greedy, run_engine

pytestmark = pytest.mark.slow

MAX_NEW = 16
QUESTIONS = ["Name three rivers.", "What is 12 times 7?", "Write a haiku about rain."]
KV_CACHE_BYTES = 32 * 2**20


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    from libs.models import prepare_model

    return prepare_model("gemma3-270m", Settings(), progress=False)


def test_greedy_matches_generate_on_gemma3(gemma_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS
    ]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)  # the template's <bos>, once
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    refs = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    del model

    settings = EngineSettings(
        kv_cache_bytes=KV_CACHE_BYTES, max_num_batched_tokens=64, prefill_chunk_tokens=8
    )
    engine = LLMEngine.from_path(gemma_dir, settings, "gemma3-270m")
    assert engine.max_model_len == 512  # Gemma 3 270M's sliding window
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    subs = [Submission(f"q{i}", p, greedy, arrive_at_step=i) for i, p in enumerate(prompts)]
    results = run_engine(engine, subs)
    for i, ref in enumerate(refs):
        assert results[(f"q{i}", 0)].token_ids == ref, f"prompt {i} diverged"
    # <end_of_turn> ends a turn as EOS does (the converter added it to the generation config).
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in engine.eos_token_ids
    with pytest.raises(BackendError, match="context"):
        engine.add_request("long", [tokenizer.bos_token_id] * 510, greedy)
