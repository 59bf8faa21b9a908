"""Speculative decoding on the real default model: a copy-heavy code edit, greedy, with each
proposer, equals ``model.generate``'s tokens, and most proposals are kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.workloads import generate
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import EngineSettings, SpeculativeSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def code_edits(smollm2: Path) -> tuple[Any, Any, list[list[int]], list[list[int]]]:
    """The model, its tokenizer, two code-edit prompts and ``model.generate``'s greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompts = []
    for req in generate("code", 2, seed=3):
        text = tok.apply_chat_template(req.messages(), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            refs.append([int(t) for t in out[0, len(ids) :]])
    return model, tok, prompts, refs


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_code_edit_equals_generate_and_keeps_proposals(
    code_edits: tuple[Any, Any, list[list[int]], list[list[int]]], method: str
) -> None:
    model, tok, prompts, refs = code_edits
    settings = EngineSettings(
        kv_cache_bytes=64 * 2**20,
        speculative=SpeculativeSettings(method=method, disable_by_batch_size=4),
    )
    engine = LLMEngine(model, tok, settings, "smollm2")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    got: dict[str, list[int]] = {}
    # One after the other: the second request of "suffix" can use the first one's output.
    for i, ids in enumerate(prompts):
        engine.add_request(f"c{i}", ids, greedy)
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.chunk.token_ids)
    assert [got["c0"], got["c1"]] == refs
    sp = engine.speculator
    assert sp is not None
    tokens = sum(len(r) for r in refs)
    print(f"{method}: {sp.num_accepted}/{sp.num_proposed} kept, {engine.num_steps} steps")
    assert sp.num_accepted > 0.5 * sp.num_proposed  # the answer copies the prompt
    assert engine.num_steps < 0.7 * tokens  # and so takes far fewer forwards than tokens


def test_a_predicted_output_equals_generate_with_speculation_off(
    code_edits: tuple[Any, Any, list[list[int]], list[list[int]]],
) -> None:
    """OpenAI's ``prediction``: the code the request edits as the predicted output, in an
    engine with speculation off. The answer is ``model.generate``'s, and proposals from the
    prediction are kept."""
    model, tok, prompts, refs = code_edits
    settings = EngineSettings(
        kv_cache_bytes=64 * 2**20, speculative=SpeculativeSettings(method="off")
    )
    engine = LLMEngine(model, tok, settings, "smollm2")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    got: dict[str, list[int]] = {}
    for i, (ids, ref) in enumerate(zip(prompts, refs, strict=True)):
        # The predicted output: the reference answer with its middle third rewritten.
        third = len(ref) // 3
        predicted = ref[:third] + tok("# rewritten\n")["input_ids"] + ref[2 * third :]
        engine.add_request(f"p{i}", ids, greedy, prediction=predicted)
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.chunk.token_ids)
    assert [got["p0"], got["p1"]] == refs
    sp = engine.speculator
    print(f"prediction: {sp.num_accepted}/{sp.num_proposed} kept, {engine.num_steps} steps")
    assert sp.num_accepted > 0.5 * sp.num_proposed
    assert engine.num_steps < 0.7 * sum(len(r) for r in refs)
