"""Speculative decoding's proposers on a tiny random-weight pair (the draft path has no real
pair here: the registry's two models have different tokenizers, docs/speculation.md).

    .venv/bin/python -m bench.spec_tiny [--tokens 256] [--prompts 4]

The target is a 4-layer llama of hidden size 256 (random weights, its last three layers' output
projections scaled down so its first layer carries most of the answer); the draft is that first
layer with the same embeddings, final norm and output head (a layer-skip draft: a small model
that shares the vocabulary by construction). Each method serves the same greedy requests
one at a time (a repetitive prompt and random ones); printed per method: output tokens/s,
forwards per output token, proposals kept / made, and whether every output equalled the run
without speculation.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import EngineSettings, SpeculativeSettings

VOCAB = 512
LATER_LAYERS_SCALE = 0.05


def models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Layers 2-4 write little into the residual stream, so the first layer alone often agrees
    # with the whole model (as a trained model's early layers partly do); random weights
    # otherwise make any two models disagree on nearly every token.
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(LATER_LAYERS_SCALE)
            layer.mlp.down_proj.weight.mul_(LATER_LAYERS_SCALE)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    return target, draft


def run(
    method: str,
    prompts: list[list[int]],
    tokens: int,
    target: torch.nn.Module,
    draft: torch.nn.Module,
) -> tuple[float, float, int, int, list[list[int]]]:
    spec = SpeculativeSettings(
        method=method if method != "off" else "off",  # type: ignore[arg-type]
        draft_model="layer-skip" if method == "draft" else "",
        prompt_lookup_min=2,
    )
    settings = EngineSettings(kv_cache_bytes=64 * 2**20, max_model_len=2048, speculative=spec)
    engine = LLMEngine(
        copy.deepcopy(target),
        None,
        settings,
        "tiny",
        draft_model=copy.deepcopy(draft) if method == "draft" else None,
    )
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.chunk.token_ids
        outs.append(out)
    wall = time.perf_counter() - t0
    sp = engine.speculator
    proposed, kept = (sp.num_proposed, sp.num_accepted) if sp else (0, 0)
    return (
        len(prompts) * tokens / wall,
        engine.num_steps / (len(prompts) * tokens),
        proposed,
        kept,
        outs,
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    rng = random.Random(0)
    loop = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = [loop * 8] + [
        [rng.randrange(VOCAB) for _ in range(64)] for _ in range(args.prompts - 1)
    ]
    target, draft = models()
    base: list[list[int]] | None = None
    print(f"{'method':<8} {'tok/s':>8} {'fwd/token':>10} {'kept/proposed':>15} {'same output':>12}")
    for method in ["off", "ngram", "suffix", "draft"]:
        tok_s, fwd, proposed, kept, outs = run(method, prompts, args.tokens, target, draft)
        if base is None:
            base = outs
        print(
            f"{method:<8} {tok_s:>8.0f} {fwd:>10.2f} {f'{kept}/{proposed}':>15} {outs == base!s:>12}"
        )


if __name__ == "__main__":
    main()
