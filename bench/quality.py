"""What each weight format costs in quality: ``strait bench quality`` / ``python -m bench.quality``.

For every format given (``--formats``; each ``quantization`` with optional ``+field=value``
engine settings, e.g. ``gguf+quant_activations=float32``, ``none+dtype=bfloat16``), on one
model, against ``none`` (the float32 weights of the same model, i.e. the converted GGUF):

- **perplexity** over a fixed text (``bench/data/quality.txt`` by default), in non-overlapping
  windows of ``--window`` tokens, one forward each (transformers' SDPA attention, the format's
  linears);
- **greedy agreement**: ``--prompts`` distinct chat prompts arriving staggered (one every other
  step) into one engine, ``--max-tokens`` greedy tokens each (``ignore_eos``); how many of them
  are token-identical to the float32 engine's, and the mean length of the common prefix.

Prints one table and writes the numbers as JSON (``--out``). The thresholds the formats are
held to (issue 25): ``gguf`` within 0.5% of float32's perplexity, ``int8`` 1%, ``int4`` and
``bfloat16`` 2%.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "quality.txt"
KV_CACHE_BYTES = 512 * 2**20  # room for every prompt and answer at once (SmolLM2: ~180 MB)
DEFAULT_FORMATS = (
    "none,gguf,gguf+quant_activations=float32,int8,int4,none+dtype=bfloat16,"
    "gguf+kv_cache_dtype=bfloat16"
)
# Relative perplexity increase allowed per quantization (issue 25); bf16 activations: 2%.
BOUNDS = {"gguf": 0.005, "int8": 0.01, "int4": 0.02, "bfloat16": 0.02}

TOPICS = [
    "rivers", "bridges", "bread", "binary numbers", "mountain walks", "the history of writing",
    "teaching", "lighthouses", "volcanoes", "bees", "chess openings", "tides", "glaciers",
    "the printing press", "compound interest", "photosynthesis", "trains", "coffee",
    "the moon", "maps", "clocks", "rain", "owls", "recycling", "sourdough", "kites",
    "the violin", "deserts", "satellites", "gardens", "marathons", "libraries",
]  # fmt: skip


@dataclass
class FormatResult:
    name: str  # quantization[+field=value...]
    weights: str  # the runner's summary: layer kinds and bytes read a step
    perplexity: float
    perplexity_delta: float  # relative to float32 (0.004 = +0.4%)
    bound: float | None
    within_bound: bool | None
    greedy_identical: int  # of len(prompts)
    greedy_common_prefix: float  # mean tokens identical from the start
    seconds: float


def parse_format(spec: str) -> dict[str, str]:
    """``gguf+quant_activations=float32`` -> {"quantization": "gguf", "quant_activations": ...}."""
    quantization, *rest = spec.split("+")
    out = {"quantization": quantization}
    for item in rest:
        field, _, value = item.partition("=")
        out[field] = value
    return out


def perplexity(model: Any, ids: list[int], window: int) -> float:
    """exp(mean NLL) over ``ids`` in non-overlapping windows (the first token of each is
    context only)."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk, use_cache=False).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def greedy_outputs(
    model: Any, settings: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], str]:
    """Every prompt through one engine, arriving one every other step, greedy; and the
    runner's summary of the weights it served."""
    from libs.engine.engine import LLMEngine
    from libs.protocol import SamplingParams

    engine = LLMEngine(model, None, settings, "quality")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, greedy)
        for o in engine.step():
            out[int(o.request_id)] += o.chunk.token_ids
        step += 1
    return [out[i] for i in range(len(prompts))], engine.runner.weights_summary()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="strait bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--formats", default=DEFAULT_FORMATS, help="quantization[+field=value...],... (engine)"
    )
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="", help="JSON path (default: bench/results/quality-<ts>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.settings import get_settings

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = get_settings()
    path = prepare_model(args.model, settings)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    text_ids = list(tokenizer(Path(args.text).read_text())["input_ids"])
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Tell me about {t}."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for t in (TOPICS * (args.prompts // len(TOPICS) + 1))[: args.prompts]
    ]
    formats = [f for f in args.formats.split(",") if f]
    if formats[0] != "none":
        formats.insert(0, "none")
    print(
        f"{args.model}: perplexity over {len(text_ids)} tokens of {Path(args.text).name} "
        f"(windows of {args.window}); greedy agreement over {len(prompts)} staggered prompts × "
        f"{args.max_tokens} tokens",
        flush=True,
    )
    base = settings.engine.model_copy(
        update={
            "max_num_seqs": max(settings.engine.max_num_seqs, len(prompts)),
            "compile": False,
            "kv_cache_bytes": KV_CACHE_BYTES,
        }
    )
    results: list[FormatResult] = []
    ref_ppl, ref_out = 0.0, []
    for spec in formats:
        t0 = time.perf_counter()
        engine_settings = base.model_copy(
            update={
                "quantization": "none",
                "dtype": "float32",
                "kv_cache_dtype": "auto",
                "quant_activations": "int8",
            }
            | parse_format(spec)
        )
        print(f"{spec}: loading...", flush=True)
        model = load_model(path, engine_settings)
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
        ppl = perplexity(model, text_ids, args.window)
        print(f"{spec}: perplexity {ppl:.4f}; greedy...", flush=True)
        outs, weights = greedy_outputs(model, engine_settings, prompts, args.max_tokens)
        if spec == "none":
            ref_ppl, ref_out = ppl, outs
        delta = ppl / ref_ppl - 1
        key = (
            engine_settings.quantization
            if engine_settings.quantization != "none"
            else engine_settings.dtype
        )
        bound = BOUNDS.get(key)
        results.append(
            FormatResult(
                name=spec,
                weights=weights,
                perplexity=ppl,
                perplexity_delta=delta,
                bound=bound,
                within_bound=None if bound is None else delta <= bound,
                greedy_identical=sum(a == b for a, b in zip(outs, ref_out, strict=True)),
                greedy_common_prefix=sum(
                    common_prefix(a, b) for a, b in zip(outs, ref_out, strict=True)
                )
                / len(outs),
                seconds=time.perf_counter() - t0,
            )
        )
        del model
    print_table(results, len(prompts), args.max_tokens)
    out = (
        Path(args.out)
        if args.out
        else (Path(__file__).parent / "results" / f"quality-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"wrote {out}")
    return 0 if all(r.within_bound is not False for r in results) else 1


def print_table(results: list[FormatResult], prompts: int, max_tokens: int) -> None:
    head = (
        f"{'format':34} {'perplexity':>10} {'vs fp32':>8} {'bound':>6} {'ok':>3} "
        f"{'greedy =':>9} {'prefix':>7}"
    )
    print()
    print(head)
    print("-" * len(head))
    for r in results:
        bound = f"{r.bound * 100:.1f}%" if r.bound is not None else "-"
        ok = "-" if r.within_bound is None else ("yes" if r.within_bound else "NO")
        print(
            f"{r.name:34} {r.perplexity:>10.4f} {r.perplexity_delta * 100:>+7.2f}% {bound:>6} "
            f"{ok:>3} {r.greedy_identical:>4}/{prompts:<4} {r.greedy_common_prefix:>5.1f}/{max_tokens}"
        )
    print(flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
