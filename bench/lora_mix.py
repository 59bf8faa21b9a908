"""Engine tokens/s with LoRA adapters mixed in one batch against the base model alone.

    python -m bench.lora_mix [--model DIR] [--streams 32] [--adapters 4] [--rank 16]

Writes ``--adapters`` random adapters of ``--rank`` on every projection (PEFT's file layout,
random A and small B) into a temporary directory, then runs, back to back and ``--rounds``
times: the base model on an engine without LoRA slots (``engine.max_loras = 0``), the base
model on an engine with ``--adapters`` slots, and the adapters mixed evenly over the streams on
that engine. Each run submits ``--streams`` requests at once (distinct prompts, greedy,
``--max-tokens`` each) and reports output tokens per second of wall time, from the first
submission to the last token, and per second of this process's CPU time (what the work costs
whatever else the machine runs: on a shared machine the wall-time ratio drifts with the
neighbours' load, the CPU-time one much less; with ``--threads 1`` it counts no idle spinning). The engine is driven directly (no fleet): what the forward's LoRA update costs, not
the fleet's overhead (``strait bench serve`` measures that).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from libs.engine.engine import LLMEngine
from libs.engine.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE
from libs.engine.lora.layers import adaptable_linears
from libs.engine.params import SamplingParams
from libs.settings import EngineSettings

PROMPT_TOKENS = 48  # tokens of each stream's random prompt
B_SCALE = 0.01  # random B's size: an update small beside the base weights, as a fine-tune's


def write_adapters(model: torch.nn.Module, directory: Path, count: int, rank: int) -> list[str]:
    """``count`` random adapters of ``model`` in PEFT's layout under ``directory``."""
    from safetensors.torch import save_file

    shapes = adaptable_linears(model)
    names = []
    for i in range(count):
        name = f"bench-{i}"
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for module, (d_in, d_out) in shapes.items():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * B_SCALE
        out = directory / name
        out.mkdir(parents=True)
        save_file(tensors, out / WEIGHTS_FILE)
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
        (out / CONFIG_FILE).write_text(json.dumps({**config, "target_modules": list(TARGETS)}))
        names.append(name)
    return names


def run(
    engine: LLMEngine, streams: int, max_tokens: int, loras: list[str], vocab: int
) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second of ``streams`` requests submitted at
    once (``loras[i % len]`` each)."""
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(streams):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(
            f"r{time.monotonic_ns()}-{i}", prompt, greedy, lora=loras[i % len(loras)]
        )
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.chunk.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".strait/models/smollm2-135m-instruct")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = EngineSettings(
        quantization=args.quantization,
        kv_cache_bytes=256 * 2**20,
        max_num_seqs=args.streams,
        max_lora_rank=args.rank,
    )
    with tempfile.TemporaryDirectory() as tmp:
        plain = LLMEngine.from_path(args.model, base, "bench")
        names = write_adapters(plain.runner.model, Path(tmp), args.adapters, args.rank)
        with_slots = base.model_copy(update={"max_loras": args.adapters, "lora_dir": tmp})
        lora = LLMEngine.from_path(args.model, with_slots, "bench")
        vocab = plain.runner.shape.vocab_size
        for r in range(args.rounds):
            a = run(plain, args.streams, args.max_tokens, [""], vocab)
            b = run(lora, args.streams, args.max_tokens, [""], vocab)
            c = run(lora, args.streams, args.max_tokens, names, vocab)
            for i, unit in enumerate(("wall", "CPU")):
                print(
                    f"round {r + 1} ({unit}): base {a[i]:.1f} tok/s | base on a "
                    f"{args.adapters}-slot engine {b[i]:.1f} ({b[i] / a[i]:.0%}) | "
                    f"{args.adapters} adapters mixed {c[i]:.1f} ({c[i] / a[i]:.0%})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
