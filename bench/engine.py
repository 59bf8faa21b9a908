"""Offline engine benchmark on the real model: Strait's engine vs transformers ``generate``.

Run: ``.venv/bin/python -m bench.engine`` (or ``strait bench engine``); ``--help`` lists the
options (fewer concurrency levels / tokens for quick runs). In one process it measures

- the machine's ceilings: fp32 matmul GFLOP/s (→ tokens/s at 2 × params FLOPs per token) and
  memory read bandwidth (→ tokens/s when every token re-reads all fp32 weights);
- per concurrency level C (C requests of ~``prompt_tokens`` tokens, ``max_tokens`` new tokens
  each, ignore_eos): the engine's aggregate output tokens/s and median step time, transformers'
  padded static batch of C, and transformers one request at a time (measured once; it does not
  depend on C);

prints a table and writes JSON to ``bench/results/``. Figures on a shared 2-core machine are
noisy: compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PASSAGE = (
    "The river leaves the mountains in a narrow gorge, where the water runs fast and cold over "
    "smooth stones. Further down the valley it widens, slows, and begins to wind through fields "
    "of wheat and small villages whose bridges are older than anyone can remember. Fishermen "
    "stand on the banks at dawn; in the evening children race paper boats along the current. "
    "Where the river meets the sea there is a port, busy with ships that carry grain, timber and "
    "travellers toward cities beyond the horizon. Summarise this description and continue the "
    "story of one of the travellers in detail."
)


@dataclass
class LevelResult:
    concurrency: int
    engine_tok_s: float
    engine_wall_s: float
    engine_median_step_ms: float
    engine_median_decode_step_ms: float
    engine_steps: int
    static_tok_s: float | None = None
    static_wall_s: float | None = None
    one_at_a_time_tok_s: float | None = None


@dataclass
class Report:
    model: str
    params: int
    weight_bytes: int
    threads: int
    prompt_tokens: int
    max_tokens: int
    matmul_gflops: float
    bandwidth_gb_s: float
    compute_ceiling_tok_s: float
    bandwidth_ceiling_tok_s: float
    levels: list[LevelResult] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- machine ceilings


def measure_matmul_gflops(n: int = 1536, repeats: int = 10) -> float:
    """Best fp32 GEMM rate (GFLOP/s) of an n×n×n product over ``repeats`` runs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def measure_bandwidth_gb_s(num_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """Best memory read bandwidth (GB/s): a sum over a buffer far larger than the caches."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


# ---------------------------------------------------------------- workloads


def make_prompts(tokenizer: Any, count: int, prompt_tokens: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``prompt_tokens`` tokens (distinct from token 0,
    so no prefix-cache hits flatter the engine)."""
    base = tokenizer(PASSAGE * 4, add_special_tokens=False)["input_ids"]
    out = []
    for i in range(count):
        head = tokenizer(f"Request {i}. ", add_special_tokens=False)["input_ids"]
        out.append((head + base)[:prompt_tokens])
    return out


def run_engine(
    engine: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[float], list[float], int]:
    """All prompts at once; returns (wall s, step times s, decode-only step times s, tokens)."""
    from libs.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", p, params)
    steps, decode_steps, tokens = [], [], 0
    while engine.has_unfinished():
        prefilling = (
            any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.num_waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        steps.append(dt)
        if not prefilling:
            decode_steps.append(dt)
        tokens += sum(len(o.chunk.token_ids) for o in outs)
    return time.perf_counter() - t0, steps, decode_steps, tokens


def run_static_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int
) -> float:
    """transformers generate on one left-padded batch; returns wall seconds."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - t0


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--skip-static", action="store_true", help="skip the padded static batch")
    p.add_argument("--skip-one-at-a-time", action="store_true")
    p.add_argument("--one-at-a-time-requests", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: settings default")
    p.add_argument("--profile", action="store_true", help="torch profiler table of engine steps")
    p.add_argument("--out", default="", help="JSON path (default: bench/results/engine-<ts>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.engine.attention import KvCache
    from libs.engine.engine import LLMEngine
    from libs.engine.model_runner import DTYPES, ModelShape
    from libs.models import prepare_model
    from libs.settings import get_settings

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    settings = get_settings()
    path = prepare_model(args.model, settings)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf_model.parameters())
    weight_bytes = params * 4

    print(f"measuring machine ceilings ({torch.get_num_threads()} threads)...", flush=True)
    gflops = measure_matmul_gflops()
    bw = measure_bandwidth_gb_s()
    report = Report(
        model=args.model,
        params=params,
        weight_bytes=weight_bytes,
        threads=torch.get_num_threads(),
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        matmul_gflops=gflops,
        bandwidth_gb_s=bw,
        compute_ceiling_tok_s=gflops * 1e9 / (2 * params),
        bandwidth_ceiling_tok_s=bw * 1e9 / weight_bytes,
    )

    engine_settings = settings.engine.model_copy()
    engine_settings.max_num_seqs = max(engine_settings.max_num_seqs, max(levels))
    if args.max_num_batched_tokens:
        engine_settings.max_num_batched_tokens = args.max_num_batched_tokens
    if not engine_settings.kv_cache_bytes:
        # Room for every sequence of the largest level twice over (tokens → bytes per block).
        need = max(levels) * (args.prompt_tokens + args.max_tokens + engine_settings.block_size)
        shape = ModelShape.of(hf_model.config)
        per_block = KvCache.bytes_per_block(
            shape.num_layers,
            engine_settings.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            DTYPES[engine_settings.dtype],
        )
        engine_settings.kv_cache_bytes = 2 * per_block * (need // engine_settings.block_size + 1)
    report.settings = engine_settings.model_dump()
    engine_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(engine_model, tokenizer, engine_settings, args.model)
    prompts_all = make_prompts(tokenizer, max(levels), args.prompt_tokens)
    run_engine(engine, prompts_all[:2], 4)  # warm-up

    one_tok_s = None
    if not args.skip_one_at_a_time:
        print("transformers generate, one request at a time...", flush=True)
        n = args.one_at_a_time_requests
        wall = sum(
            run_static_batch(hf_model, tokenizer, [p], args.max_tokens) for p in prompts_all[:n]
        )
        one_tok_s = n * args.max_tokens / wall

    for c in levels:
        prompts = prompts_all[:c]
        print(f"concurrency {c}: engine...", flush=True)
        if args.profile and c == max(levels):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall, steps, dsteps, tokens = run_engine(engine, prompts, args.max_tokens)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        else:
            wall, steps, dsteps, tokens = run_engine(engine, prompts, args.max_tokens)
        res = LevelResult(
            concurrency=c,
            engine_tok_s=tokens / wall,
            engine_wall_s=wall,
            engine_median_step_ms=statistics.median(steps) * 1e3,
            engine_median_decode_step_ms=statistics.median(dsteps or steps) * 1e3,
            engine_steps=len(steps),
            one_at_a_time_tok_s=one_tok_s,
        )
        if not args.skip_static:
            print(f"concurrency {c}: transformers padded static batch...", flush=True)
            res.static_wall_s = run_static_batch(hf_model, tokenizer, prompts, args.max_tokens)
            res.static_tok_s = c * args.max_tokens / res.static_wall_s
        report.levels.append(res)
        print_table(report)

    out = (
        Path(args.out)
        if args.out
        else RESULTS_DIR / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(report), indent=2))
    print(f"wrote {out}")
    return 0


def print_table(r: Report) -> None:
    print()
    print(
        f"{r.model}: {r.params / 1e6:.1f}M params, {r.threads} threads, "
        f"{r.prompt_tokens}-token prompts, {r.max_tokens} new tokens (ignore_eos)"
    )
    print(
        f"ceilings: matmul {r.matmul_gflops:.0f} GFLOP/s -> {r.compute_ceiling_tok_s:.0f} tok/s; "
        f"bandwidth {r.bandwidth_gb_s:.1f} GB/s -> {r.bandwidth_ceiling_tok_s:.1f} tok/s (batch 1)"
    )
    head = (
        f"{'conc':>5} {'engine tok/s':>12} {'step ms':>8} {'decode ms':>9} {'static tok/s':>12} "
        f"{'1-by-1 tok/s':>12} {'vs static':>9} {'%compute':>8} {'%bandw':>7}"
    )
    print(head)
    print("-" * len(head))
    for lv in r.levels:
        vs = f"{lv.engine_tok_s / lv.static_tok_s:.2f}x" if lv.static_tok_s else "-"
        static = f"{lv.static_tok_s:.1f}" if lv.static_tok_s else "-"
        one = f"{lv.one_at_a_time_tok_s:.1f}" if lv.one_at_a_time_tok_s else "-"
        print(
            f"{lv.concurrency:>5} {lv.engine_tok_s:>12.1f} {lv.engine_median_step_ms:>8.1f} "
            f"{lv.engine_median_decode_step_ms:>9.1f} {static:>12} {one:>12} {vs:>9} "
            f"{100 * lv.engine_tok_s / r.compute_ceiling_tok_s:>7.0f}% "
            f"{100 * lv.engine_tok_s / r.bandwidth_ceiling_tok_s:>6.0f}%"
        )
    print(flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
