"""What structured outputs cost the engine: the same 32 streams with and without one JSON schema.

Run: ``strait bench structured`` (``--help`` for options). On the default model and
engine settings (``configs/strait.toml``, so compiled when that says so), in one process:

1. compile time of ``--schemas`` distinct JSON schemas through ``Grammars.compile`` (the
   worker's path: llguidance grammar text, validated against the tokenizer), p50 and p99, and a
   cached one;
2. ``--concurrency`` streams of the same prompts, ``--max-tokens`` each, run unconstrained and
   then all under one schema whose answer cannot end before ``--max-tokens`` (a long required
   string), alternating ``--repeats`` times; output tokens/s of each (the best run) and their
   ratio, the mask time per step (fill + apply of every constrained row), and the share of the
   constrained answers that parse and validate.

Prints a table and writes JSON to ``bench/results/``. Compare ratios from one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def story_schema(min_chars: int) -> dict[str, Any]:
    """An answer that needs at least ``min_chars`` characters of story (so no stream ends before
    its token budget) and then a closed field."""
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "story": {"type": "string", "minLength": min_chars, "maxLength": min_chars * 2},
            "mood": {"enum": ["calm", "tense", "joyful"]},
        },
        "required": ["title", "story", "mood"],
        "additionalProperties": False,
    }


def distinct_schemas(n: int) -> list[dict[str, Any]]:
    """``n`` small schemas that differ in their field names (no two hit one cache entry)."""
    return [
        {
            "type": "object",
            "properties": {
                f"name_{i}": {"type": "string", "maxLength": 30},
                f"age_{i}": {"type": "integer", "minimum": 0, "maximum": 150},
                f"tags_{i}": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "kind": {"enum": ["a", "b", "c"]},
            },
            "required": [f"name_{i}", f"age_{i}", "kind"],
        }
        for i in range(n)
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--schemas", type=int, default=50, help="distinct schemas to compile")
    p.add_argument("--out", type=Path, help="JSON path (default: bench/results/<UTC>.json)")
    return p.parse_args(argv)


def run(engine: Any, prompts: list[list[int]], max_tokens: int, grammar: str | None) -> dict:
    """All prompts at once until every stream ends: tokens/s, decode steps, texts."""
    from libs.engine import metrics
    from libs.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=grammar is None)
    mask_before = _histogram_sum(metrics.GRAMMAR_MASK)
    t0 = time.perf_counter()
    ids = [f"s{i}-{t0}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params, grammar=grammar)
    texts = dict.fromkeys(ids, "")
    reasons: dict[str, str | None] = dict.fromkeys(ids)
    tokens = steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] += o.chunk.text
            tokens += len(o.chunk.token_ids)
            reasons[o.request_id] = o.chunk.finish_reason or reasons[o.request_id]
        steps += 1
    wall = time.perf_counter() - t0
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "steps": steps,
        "mask_ms_per_step": (_histogram_sum(metrics.GRAMMAR_MASK) - mask_before) * 1e3 / steps,
        "texts": list(texts.values()),
        "reasons": list(reasons.values()),
    }


def _histogram_sum(h: Any) -> float:
    for metric in h.collect():
        for s in metric.samples:
            if s.name.endswith("_sum"):
                return float(s.value)
    return 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jsonschema
    from transformers import AutoTokenizer

    from bench.engine import make_prompts
    from libs.engine.engine import LLMEngine
    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.protocol import StructuredOutput
    from libs.settings import get_settings

    settings = get_settings()
    path = prepare_model(args.model, settings)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    es = settings.engine.model_copy()
    es.max_num_seqs = max(es.max_num_seqs, args.concurrency)
    print(f"loading {args.model} (compile={es.compile}; a first compile takes minutes)...")
    engine = LLMEngine(load_model(path, es), tokenizer, es, args.model)
    grammars = engine.grammars
    assert grammars is not None
    print(f"weights: {engine.runner.weights_summary()}")

    t = time.perf_counter()
    grammars.compile(StructuredOutput(json={"type": "object"}), None)
    tokenizer_setup_ms = (time.perf_counter() - t) * 1e3
    compile_ms = []
    for schema in distinct_schemas(args.schemas):
        t = time.perf_counter()
        grammars.compile(StructuredOutput(json=schema), None)
        compile_ms.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    grammars.compile(StructuredOutput(json=distinct_schemas(1)[0]), None)
    cached_ms = (time.perf_counter() - t) * 1e3

    # ~4 characters a token: a story this long cannot close within max_tokens.
    schema = story_schema(min_chars=args.max_tokens * 6)
    grammar = grammars.compile(StructuredOutput(json=schema), None)
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for r in range(args.repeats):
        for name, g in (("unconstrained", None), ("json_schema", grammar)):
            prompts = make_prompts(tokenizer, args.concurrency, 64, tag=f"{name}{r} ")
            res = run(engine, prompts, args.max_tokens, g)
            runs[name].append(res)
            print(
                f"  run {r} {name:13s} {res['tok_s']:7.1f} tok/s  mask {res['mask_ms_per_step']:.3f} ms/step"
            )
    best = {k: max(v, key=lambda x: x["tok_s"]) for k, v in runs.items()}
    # Cut by max_tokens on purpose: validity is checked on a schema run that may finish.
    finished = run(
        engine,
        make_prompts(tokenizer, args.concurrency, 64, tag="valid "),
        args.max_tokens * 4,
        grammars.compile(StructuredOutput(json=story_schema(min_chars=40)), None),
    )
    valid = 0
    for text, reason in zip(finished["texts"], finished["reasons"], strict=True):
        try:
            jsonschema.validate(json.loads(text), story_schema(min_chars=40))
            valid += reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass

    ratio = best["json_schema"]["tok_s"] / best["unconstrained"]["tok_s"]
    q = statistics.quantiles(compile_ms, n=100)
    report = {
        "model": args.model,
        "weights": engine.runner.weights_summary(),
        "compile": es.compile,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "tokenizer_setup_ms": tokenizer_setup_ms,
        "schema_compile_ms": {"p50": q[49], "p99": q[98], "cached": cached_ms},
        "unconstrained_tok_s": best["unconstrained"]["tok_s"],
        "json_schema_tok_s": best["json_schema"]["tok_s"],
        "ratio": ratio,
        "mask_ms_per_step": best["json_schema"]["mask_ms_per_step"],
        "valid": f"{valid}/{args.concurrency}",
        "runs_tok_s": {k: [x["tok_s"] for x in v] for k, v in runs.items()},
    }
    print()
    print(f"| {args.concurrency} streams × {args.max_tokens} tokens | tokens/s |")
    print("| --- | --- |")
    print(f"| unconstrained | {report['unconstrained_tok_s']:.1f} |")
    print(f"| one JSON schema | {report['json_schema_tok_s']:.1f} ({ratio:.2f}×) |")
    print(
        f"mask per step {report['mask_ms_per_step']:.3f} ms; schema compile p50 "
        f"{q[49]:.2f} ms, p99 {q[98]:.2f} ms, cached {cached_ms:.3f} ms (tokenizer set-up "
        f"{tokenizer_setup_ms:.0f} ms once); valid answers {report['valid']}"
    )
    out = (
        args.out
        or RESULTS_DIR / f"structured-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
