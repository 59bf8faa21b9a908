"""Offline engine benchmark on the real model: Strait's engine vs transformers ``generate``.

Run: ``.venv/bin/python -m bench.engine`` (or ``strait bench engine``); ``--help`` lists the
options (fewer concurrency levels / tokens for quick runs). In one process it measures

- the machine's ceilings, before the levels and again after them (the higher counts): fp32
  matmul GFLOP/s (→ tokens/s at 2 × params FLOPs per token) and
  memory read bandwidth (→ tokens/s when every token re-reads all fp32 weights);
- per concurrency level C (C requests of ~``prompt_tokens`` tokens, ``max_tokens`` new tokens
  each, ignore_eos): the engine's aggregate output tokens/s and median step time, transformers'
  padded static batch of C, and transformers one request at a time (measured once; it does not
  depend on C); with ``--repeats R`` the engine and the static batch alternate R times per level
  and the fastest run of each is reported (every run is kept in the JSON);

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
    engine_cached_prompt_tokens: int = 0
    engine_runs_tok_s: list[float] = field(default_factory=list)
    static_runs_tok_s: list[float] = field(default_factory=list)


@dataclass
class Report:
    model: str
    params: int
    weight_bytes: int
    threads: int
    prompt_tokens: int
    max_tokens: int
    matmul_gflops: float  # the higher of the start and end measurements
    bandwidth_gb_s: float  # likewise: this VM's memory rate changes by up to 1.7x within minutes
    compute_ceiling_tok_s: float
    bandwidth_ceiling_tok_s: float
    levels: list[LevelResult] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # (GFLOP/s, GB/s) measured before the levels and after them
    ceilings_measured: list[tuple[float, float]] = field(default_factory=list)
    # concurrency -> the decode step's split (step_split), ms
    splits: dict[str, dict[str, float]] = field(default_factory=dict)


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


def make_prompts(tokenizer: Any, count: int, prompt_tokens: int, tag: str = "") -> list[list[int]]:
    """``count`` distinct prompts of exactly ``prompt_tokens`` tokens, distinct from token 0 (so
    no prefix-cache hits flatter the engine). ``tag`` makes each run's prompts new too: the
    engine keeps freed blocks cached, so a later run reusing a prompt would get hits."""
    base = tokenizer(PASSAGE * 4, add_special_tokens=False)["input_ids"]
    out = []
    for i in range(count):
        head = tokenizer(f"{tag}Request {i}. ", add_special_tokens=False)["input_ids"]
        out.append((head + base)[:prompt_tokens])
    return out


@dataclass
class EngineRun:
    wall_s: float
    steps: list[float]  # seconds of every step
    decode_steps: list[float]  # seconds of the steps with no prefill in them
    tokens: int  # output tokens
    cached_tokens: int  # prompt tokens served from the prefix cache (0 expected)


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> EngineRun:
    """All prompts at once, stepped until every request finishes."""
    from libs.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", p, params)
    steps, decode_steps, tokens, cached = [], [], 0, 0
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
        cached += sum(o.chunk.num_cached_tokens for o in outs if o.request_finished)
    return EngineRun(time.perf_counter() - t0, steps, decode_steps, tokens, cached)


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
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per level and side; the fastest is reported"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: settings default")
    p.add_argument(
        "--cpu-kernels",
        choices=["auto", "on", "off"],
        default="",
        help="engine.cpu_kernels for the engine (default: the settings'); off = torch's kernels",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="engine.compile on: torch.compile the forward (compiled while the engine is built; "
        "configs/strait.toml already turns it on, STRAIT_ENGINE__COMPILE=false turns it off)",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "gguf", "int4", "int8"],
        default="",
        help="engine.quantization (default: the settings')",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="")
    p.add_argument(
        "--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"], default=""
    )
    p.add_argument(
        "--no-split",
        action="store_true",
        help="skip the profiled pass that splits a decode step into linears, attention, rest",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the measurements, one extra profiled engine run at the largest level",
    )
    p.add_argument("--out", default="", help="JSON path (default: bench/results/engine-<ts>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.engine.attention import KvCache
    from libs.engine.engine import LLMEngine
    from libs.engine.loader import DTYPES, ModelShape, load_model
    from libs.models import prepare_model
    from libs.settings import get_settings

    levels = [int(x) for x in args.concurrency.split(",") if x]
    settings = get_settings()
    if args.threads:
        torch.set_num_threads(args.threads)
    elif settings.engine.num_threads:  # the workers' own count (engine.num_threads)
        torch.set_num_threads(settings.engine.threads())
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
        matmul_gflops=0.0,
        bandwidth_gb_s=0.0,
        compute_ceiling_tok_s=0.0,
        bandwidth_ceiling_tok_s=0.0,
    )
    set_ceilings(report, gflops, bw)

    engine_settings = settings.engine.model_copy()
    engine_settings.max_num_seqs = max(engine_settings.max_num_seqs, max(levels))
    if args.max_num_batched_tokens:
        engine_settings.max_num_batched_tokens = args.max_num_batched_tokens
    if args.cpu_kernels:
        engine_settings.cpu_kernels = args.cpu_kernels
    if args.compile:
        engine_settings.compile = True
    if args.quantization:
        engine_settings.quantization = args.quantization
    if args.dtype:
        engine_settings.dtype = args.dtype
    if args.kv_cache_dtype:
        engine_settings.kv_cache_dtype = args.kv_cache_dtype
    if not engine_settings.kv_cache_bytes:
        # Room for every sequence of the largest level twice over (tokens → bytes per block).
        need = max(levels) * (args.prompt_tokens + args.max_tokens + engine_settings.block_size)
        shape = ModelShape.of(hf_model.config)
        per_block = KvCache.bytes_per_block(
            shape.num_layers,
            engine_settings.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            DTYPES[engine_settings.kv_dtype],
        )
        engine_settings.kv_cache_bytes = 2 * per_block * (need // engine_settings.block_size + 1)
    report.settings = engine_settings.model_dump()
    engine_model = load_model(path, engine_settings)
    if engine_settings.compile:  # the engine compiles its graphs while it is built
        print("compiling the forward (~5 min; cached on disk for later runs)...", flush=True)
    engine = LLMEngine(engine_model, tokenizer, engine_settings, args.model)
    report.settings["cpu_kernels_in_use"] = engine.runner.kernels is not None
    compiled = " + torch.compile" if engine.runner.compiling else ""
    print(f"engine kernels: {'Strait CPU' if engine.runner.kernels else 'torch'}{compiled}")
    print(f"weights: {engine.runner.weights_summary()}")
    report.settings["weights"] = engine.runner.weights_summary()
    # The bandwidth ceiling counts the bytes one decode step reads: every linear's weights in
    # the format they are served in (embeddings are read one row per token).
    report.weight_bytes = engine.runner.linear_weight_bytes()
    report.bandwidth_ceiling_tok_s = report.bandwidth_gb_s * 1e9 / report.weight_bytes
    # Warm both sides up (first calls allocate and pick kernels) with prompts not reused later.
    warm = make_prompts(tokenizer, 3, args.prompt_tokens, tag="Warm-up. ")
    run_engine(engine, warm[:1], 4)
    run_engine(engine, warm[1:], 4)
    run_static_batch(hf_model, tokenizer, warm, 4)

    one_tok_s = None
    if not args.skip_one_at_a_time:
        print("transformers generate, one request at a time...", flush=True)
        n = args.one_at_a_time_requests
        singles = make_prompts(tokenizer, n, args.prompt_tokens, tag="Single. ")
        wall = sum(run_static_batch(hf_model, tokenizer, [p], args.max_tokens) for p in singles)
        one_tok_s = n * args.max_tokens / wall

    for c in levels:
        # Engine and static batch alternate, ``--repeats`` times each, and the fastest run of
        # each side is reported (all runs are kept in the JSON): on a shared machine, other
        # work slows single runs down by up to 2x, and both sides get the same treatment.
        best: EngineRun | None = None
        engine_runs, static_runs = [], []
        for r in range(args.repeats):
            # New prompts every run: the engine keeps freed blocks cached (no flattering hits).
            prompts = make_prompts(tokenizer, c, args.prompt_tokens, tag=f"Level {c} run {r}. ")
            print(f"concurrency {c}: engine (run {r + 1}/{args.repeats})...", flush=True)
            run = run_engine(engine, prompts, args.max_tokens)
            engine_runs.append(run.tokens / run.wall_s)
            if best is None or run.wall_s < best.wall_s:
                best = run
            if not args.skip_static:
                print(f"concurrency {c}: transformers padded static batch...", flush=True)
                wall = run_static_batch(hf_model, tokenizer, prompts, args.max_tokens)
                static_runs.append(wall)
        assert best is not None
        res = LevelResult(
            concurrency=c,
            engine_tok_s=best.tokens / best.wall_s,
            engine_wall_s=best.wall_s,
            engine_median_step_ms=statistics.median(best.steps) * 1e3,
            engine_median_decode_step_ms=statistics.median(best.decode_steps or best.steps) * 1e3,
            engine_steps=len(best.steps),
            one_at_a_time_tok_s=one_tok_s,
            engine_cached_prompt_tokens=best.cached_tokens,
            engine_runs_tok_s=engine_runs,
        )
        if static_runs:
            res.static_wall_s = min(static_runs)
            res.static_tok_s = c * args.max_tokens / res.static_wall_s
            res.static_runs_tok_s = [c * args.max_tokens / w for w in static_runs]
        report.levels.append(res)
        print_table(report)

    # Ceilings again: the higher of the two measurements is the one the figures are held to.
    print("measuring machine ceilings again...", flush=True)
    set_ceilings(report, measure_matmul_gflops(), measure_bandwidth_gb_s())
    print_table(report)

    if not args.no_split:
        for c in levels:
            split = step_split(engine, tokenizer, c, args.prompt_tokens)
            report.splits[str(c)] = split
            print(
                f"decode step at concurrency {c} (profiled pass, not part of the figures): "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()),
                flush=True,
            )

    if args.profile:
        # A separate, unmeasured pass: the profiler's overhead must not reach the figures.
        from torch.profiler import ProfilerActivity, profile

        c = max(levels)
        prompts = make_prompts(tokenizer, c, args.prompt_tokens, tag="Profile. ")
        print(f"profiling the engine at concurrency {c} (not part of the figures)...", flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_engine(engine, prompts, args.max_tokens)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    out = (
        Path(args.out)
        if args.out
        else RESULTS_DIR / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(report), indent=2))
    print(f"wrote {out}")
    return 0


# Profiler op names -> the part of a step they are (self CPU time; everything else the forward
# runs is "other ops", and wall time no op accounts for is Python and the framework).
SPLIT_PARTS = {
    "linears": (
        "strait::block_linear",
        "strait::packed_linear",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm",
        "aten::mm",
        "aten::addmm",
        "aten::linear",
    ),
    "attention": ("strait::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"),
}


def step_split(engine: Any, tokenizer: Any, c: int, prompt_tokens: int) -> dict[str, float]:
    """Where one decode step's time goes at concurrency ``c``: ms per step of linears,
    attention, other ops, and the rest of the wall time (Python, dispatch, framework), from
    ``torch.profiler`` over 16 decode steps (a separate pass; its overhead inflates "rest")."""
    from torch.profiler import ProfilerActivity, profile

    from libs.protocol import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(tokenizer, c, prompt_tokens, tag="Split. ")):
        engine.add_request(f"split-{c}-{i}", p, params)
    while engine.scheduler.num_waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    n = 16
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        wall = (time.perf_counter() - t0) / n * 1e3
    while engine.has_unfinished():
        engine.step()
    parts = dict.fromkeys(SPLIT_PARTS, 0.0)
    ops = 0.0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / n
        # The compiled graph's own time is its fused kernels: "other ops".
        ops += ms
        for part, names in SPLIT_PARTS.items():
            if e.key in names:
                parts[part] += ms
    other = ops - sum(parts.values())
    return {"step": wall, **parts, "other ops": other, "rest": max(wall - ops, 0.0)}


def set_ceilings(r: Report, gflops: float, bw: float) -> None:
    """Record one ceiling measurement; the report keeps the highest of each seen so far."""
    r.ceilings_measured.append((gflops, bw))
    r.matmul_gflops = max(g for g, _ in r.ceilings_measured)
    r.bandwidth_gb_s = max(b for _, b in r.ceilings_measured)
    r.compute_ceiling_tok_s = r.matmul_gflops * 1e9 / (2 * r.params)
    r.bandwidth_ceiling_tok_s = r.bandwidth_gb_s * 1e9 / r.weight_bytes


def print_table(r: Report) -> None:
    print()
    print(
        f"{r.model}: {r.params / 1e6:.1f}M params, {r.threads} threads, "
        f"{r.prompt_tokens}-token prompts, {r.max_tokens} new tokens (ignore_eos)"
    )
    print(
        f"ceilings: matmul {r.matmul_gflops:.0f} GFLOP/s -> {r.compute_ceiling_tok_s:.0f} tok/s; "
        f"bandwidth {r.bandwidth_gb_s:.1f} GB/s -> {r.bandwidth_ceiling_tok_s:.1f} tok/s (batch 1); "
        "measured: " + ", ".join(f"{g:.0f} GFLOP/s {b:.1f} GB/s" for g, b in r.ceilings_measured)
    )
    head = (
        f"{'conc':>5} {'engine tok/s':>12} {'step ms':>8} {'decode ms':>9} {'static tok/s':>12} "
        f"{'1-by-1 tok/s':>12} {'vs static':>9} {'%compute':>8} {'%c+prompt':>9} {'%bandw':>7}"
    )
    print(head)
    print("-" * len(head))
    # %compute counts output tokens only (the measure); every request also runs its
    # prompt through the same matmuls, so output tokens/s cannot pass
    # ceiling * max_tokens / (prompt_tokens + max_tokens). %c+prompt counts both.
    processed = (r.prompt_tokens + r.max_tokens) / r.max_tokens
    for lv in r.levels:
        vs = f"{lv.engine_tok_s / lv.static_tok_s:.2f}x" if lv.static_tok_s else "-"
        static = f"{lv.static_tok_s:.1f}" if lv.static_tok_s else "-"
        one = f"{lv.one_at_a_time_tok_s:.1f}" if lv.one_at_a_time_tok_s else "-"
        print(
            f"{lv.concurrency:>5} {lv.engine_tok_s:>12.1f} {lv.engine_median_step_ms:>8.1f} "
            f"{lv.engine_median_decode_step_ms:>9.1f} {static:>12} {one:>12} {vs:>9} "
            f"{100 * lv.engine_tok_s / r.compute_ceiling_tok_s:>7.0f}% "
            f"{100 * lv.engine_tok_s * processed / r.compute_ceiling_tok_s:>8.0f}% "
            f"{100 * lv.engine_tok_s / r.bandwidth_ceiling_tok_s:>6.0f}%"
        )
    print(flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
