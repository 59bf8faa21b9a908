"""LoRA adapters on SmolLM2-135M-Instruct: a random adapter made here with ``peft`` over the
local weights (no download), served by the engine beside the base model in one batch, answers
as ``peft``'s merged model's ``generate`` in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.slow.test_engine_smollm2 import chat_prompts
from tests.unit.engine.helpers import reference_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
peft = pytest.importorskip("peft")

MAX_NEW = 16


def test_an_adapter_and_the_base_in_one_batch_answer_as_peft_merged(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = chat_prompts(tokenizer)[:3]

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    base_refs = [reference_greedy(load(), p, MAX_NEW) for p in prompts]
    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,
    )
    tuned = peft.get_peft_model(load(), cfg)
    tuned.save_pretrained(tmp_path / "tuned")
    merged = tuned.merge_and_unload().eval()
    refs = [reference_greedy(merged, p, MAX_NEW) for p in prompts]
    assert refs != base_refs  # the adapter changes the answers

    settings = EngineSettings(
        kv_cache_bytes=64 * 2**20, max_loras=2, max_lora_rank=8, lora_dir=str(tmp_path)
    )
    engine = LLMEngine(load(), None, settings, "smollm2-135m-instruct")
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)  # stops at EOS, as generate
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, greedy, lora="tuned")
        engine.add_request(f"b{i}", p, greedy)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.chunk.token_ids)
    assert [out[f"t{i}"] for i in range(len(prompts))] == refs
    assert [out[f"b{i}"] for i in range(len(prompts))] == base_refs
