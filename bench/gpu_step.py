"""The engine on a GPU, in one go: tokens/s at several stream counts for each way of running
the step, transformers' compiled static-cache ``generate`` beside it, and the roofline.

    python3 -m bench.gpu_step --model-dir DIR                      # a GPU (bench/gpu_step.sh)
    .venv/bin/python -m bench.gpu_step --device cpu --tiny         # a dry run of every path

Per variant (``eager`` / ``graphs`` / ``graphs+compile`` × float32 / bfloat16) and per stream
count C: C requests of ``--prompt-tokens`` random token ids, ``--max-tokens`` new tokens each
(greedy, ``ignore_eos``), all submitted at once; a warm-up run of the same requests first (it
captures the decode graphs the timed run replays), then the timed run. Reported: output tokens
over the run's wall time (prefill included), the median decode-only step, and that step
against the roofline: the bytes a decode step must read (the linear and norm weights once,
the LM head once, each row's K/V) over the device's copy bandwidth measured at start.

``--peer`` adds transformers' own best path on the same device: ``generate`` with
``cache_implementation="static"``, which transformers compiles (``torch.compile``, CUDA
graphs) itself on a GPU; one warm-up (the compile), then the timed run.

Weights: the model directory's when it holds them, else random ones drawn from its
``config.json`` (``--random-weights``): with ``ignore_eos`` and fixed lengths the time of a step
does not depend on the values, and the directory then travels in a few KB. Greedy agreement of
the variants with the float32 eager engine is printed for the first requests (bf16 and padded
shapes may differ from float32 after a near tie; the float32 contract is ``pytest -m gpu``'s).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.protocol import SamplingParams


@dataclass
class Level:
    variant: str
    streams: int
    tok_s: float
    wall_s: float
    steps: int
    decode_step_ms: float
    graph_replays: int
    roofline_tok_s: float
    same_as_reference: str = ""
    attention: str = ""
    # Where the run's wall time went: the steps with prompt tokens, the decode steps, the rest
    # (between steps: the bench's own loop).
    other_steps_ms: float = 0.0
    decode_steps_ms: float = 0.0
    decode_step_mean_ms: float = 0.0


@dataclass
class Report:
    device: str
    torch: str
    transformers: str
    params: int
    weights: str
    prompt_tokens: int
    max_tokens: int
    copy_gb_s: float
    levels: list[Level] = field(default_factory=list)
    peer: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def copy_bandwidth_gb_s(device: torch.device) -> float:
    """Device-to-device copy rate, bytes read plus written (GB/s); the roofline's ceiling."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    a = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> Any:
    """The model in ``dtype`` on ``device``: the directory's weights, or random ones (seed 0,
    the same for every call) from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.tiny:
        from bench.support.tiny_models import tiny_config

        config = tiny_config("llama", vocab_size=512)
    else:
        config = AutoConfig.from_pretrained(args.model_dir)
    if args.tiny or args.random_weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    from libs.engine.loader import ModelShape

    s = ModelShape.of(model.config)
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim * dtype.itemsize


def decode_step_bytes(model: Any, dtype: torch.dtype, streams: int, context: int) -> int:
    """Bytes a decode step of ``streams`` rows must read: every weight but the embedding table
    once (the LM head reads it when tied), one embedding row a stream, and each row's K/V."""
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    tied = model.config.tie_word_embeddings
    embed = model.get_input_embeddings().weight
    weights += embed.numel() if tied else 0
    rows = streams * embed.shape[1]
    return (weights + rows) * dtype.itemsize + streams * context * kv_bytes_per_token(model, dtype)


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


@dataclass
class Run:
    wall_s: float
    steps: int
    decode_ms: list[float]  # each decode-only step
    other_ms: list[float]  # each step with prompt tokens
    outputs: list[list[int]]

    @property
    def median_decode_ms(self) -> float:
        return statistics.median(self.decode_ms) if self.decode_ms else 0.0


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int) -> Run:
    """Every prompt at once, stepped to the end; each step timed."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    decode_ms: list[float] = []
    other_ms: list[float] = []
    steps = 0
    device = engine.runner.device
    sync(device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        ms = (time.perf_counter() - s0) * 1e3
        (decode_ms if engine.last_step_decode_only else other_ms).append(ms)
        steps += 1
        for out in outs:
            outputs[int(out.request_id[1:])] += out.chunk.token_ids
    sync(device)
    return Run(time.perf_counter() - t0, steps, decode_ms, other_ms, outputs)


VARIANTS = {
    # name: (dtype, CUDA graphs, compile, engine.cuda_attention)
    # The engine as it was: every step eager, torch's gather + SDPA (the baseline).
    "eager-fp32": ("float32", False, False, "sdpa"),
    "eager-bf16": ("bfloat16", False, False, "sdpa"),
    # Eager steps with Triton's kernel (prefill rows too): what the graphs add beyond it.
    "eager-triton-bf16": ("bfloat16", False, False, "auto"),
    "graphs-fp32": ("float32", True, False, "auto"),
    "graphs-bf16": ("bfloat16", True, False, "auto"),
    "graphs+compile-bf16": ("bfloat16", True, True, "auto"),
    "graphs+compile-fp32": ("float32", True, True, "auto"),
    # Graphs for decode steps only (engine.cuda_graph_max_tokens = 0): prompt steps eager.
    "graphs+compile-bf16-decode-graphs": ("bfloat16", True, True, "auto"),
    # No step launched ahead (engine.cuda_run_ahead = false): the host waits for every step.
    "graphs+compile-bf16-no-ahead": ("bfloat16", True, True, "auto"),
    # The graphs' attention as a gather of whole blocks and torch's SDPA instead of Triton's
    # paged kernel (what the first sitting ran).
    "graphs-sdpa-bf16": ("bfloat16", True, False, "sdpa"),
    "graphs+compile-sdpa-bf16": ("bfloat16", True, True, "sdpa"),
    # The same graphs captured by torch.compile(mode="reduce-overhead") (cudagraph trees) over
    # the eager forward instead of torch.cuda.CUDAGraph: the alternative decision 0018 weighs.
    "reduce-overhead-bf16": ("bfloat16", True, False, "auto"),
}


# Settings a variant sets beyond its tuple above.
VARIANT_SETTINGS: dict[str, dict[str, Any]] = {
    "graphs+compile-bf16-decode-graphs": {"cuda_graph_max_tokens": 0},
    "graphs+compile-bf16-no-ahead": {"cuda_run_ahead": False},
}


def reduce_overhead_capture(cache: torch.Tensor) -> Any:
    """A ``Capture`` by ``torch.compile(mode="reduce-overhead")``: the KV cache marked a static
    address (cudagraph trees would copy or skip a mutated input otherwise)."""
    torch._dynamo.mark_static_address(cache)
    # Every graph is the same function over other buffers: one dynamo entry each.
    torch._dynamo.config.cache_size_limit = 64

    def capture(fn: Any) -> Any:
        # The step's own buffers (refilled in place every step) are static addresses too.
        for cell in fn.__closure__ or ():
            if isinstance(cell.cell_contents, torch.Tensor):
                with contextlib.suppress(Exception):  # a view cannot be marked; its base is
                    torch._dynamo.mark_static_address(cell.cell_contents)
        compiled = torch.compile(fn, mode="reduce-overhead")
        for _ in range(3):  # compile, warm up, record
            compiled()
        return compiled

    return capture


def make_engine(args: argparse.Namespace, variant: str, device: torch.device) -> Any:
    from libs.engine.cuda_graphs import eager_capture
    from libs.engine.engine import LLMEngine
    from libs.settings import EngineSettings

    dtype, graphs, compile_, attention = VARIANTS[variant]
    streams = max(args.streams)
    settings = EngineSettings(
        device=str(device),
        dtype=dtype,
        cpu_kernels="off",
        compile=compile_,
        cuda_graphs=graphs,
        max_num_seqs=streams,
        # Every prompt of the largest level in a few steps (prefill runs eager).
        max_num_batched_tokens=max(512, min(8192, streams * args.prompt_tokens)),
        prefill_chunk_tokens=0,
        kv_cache_bytes=args.kv_gib * 2**30,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
        cuda_attention=args.attention or attention,
        **VARIANT_SETTINGS.get(variant, {}),
        **(
            {}
            if args.graph_max_tokens is None
            else {"cuda_graph_max_tokens": args.graph_max_tokens}
        ),
    )
    model = build_model(args, getattr(torch, dtype), device)
    # On a CPU (a dry run) the graphs' bookkeeping runs without graphs.
    capture = eager_capture if graphs and device.type == "cpu" else None
    if variant.startswith("reduce-overhead"):
        engine = LLMEngine(model, None, settings, "bench", graph_capture=eager_capture)
        assert engine.runner.graphs is not None
        # The runner's cache exists only now: swap the capture before the first graph.
        engine.runner.graphs.capture = reduce_overhead_capture(engine.runner.kv_cache.data)
        engine.runner.graphs.graphs.clear()  # the start's captures were eager ones
        return engine, model
    return LLMEngine(model, None, settings, "bench", graph_capture=capture), model


def kernels_of_a_step(engine: Any, out: list[str]) -> None:
    """Kernels one decode step launches (what a graph replays), profiled eagerly on the
    smallest captured graph: the count and the most frequent."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    if graphs is None or not graphs.graphs or engine.runner.device.type != "cuda":
        return
    key = min(graphs.graphs)
    g = graphs.graphs[key]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        g.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    counts: dict[str, int] = {}
    for e in events:
        counts[e.name[:60]] = counts.get(e.name[:60], 0) + 1
    busy_us = sum(e.device_time for e in events)
    times: dict[str, float] = {}
    for e in events:
        times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    slow = sorted(times.items(), key=lambda kv: -kv[1])[:8]
    line = (
        f"one step of {key[0]} rows x {key[1]} blocks: {len(events)} kernels, "
        f"{busy_us / 1e3:.2f} ms busy; most launched: "
        + "; ".join(f"{n} x{c}" for n, c in top)
        + "; most time (us): "
        + "; ".join(f"{n} {t:.0f} (x{counts[n]})" for n, t in slow)
    )
    out.append(line)
    print("  " + line, flush=True)


def attention_sweep(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """Triton's paged kernel alone over SmolLM2's attention shapes, per launch shape (keys an
    iteration, warps): microseconds a call at 1, 8, 64 and 256 rows of ``context`` keys."""
    from libs.engine import triton_attention

    if device.type != "cuda" or not triton_attention.AVAILABLE:
        return
    hkv, groups, d, bs = 3, 3, 64, 16
    context = args.prompt_tokens + args.max_tokens
    width = -(-context // bs)
    for rows in (1, 8, 64, 256):
        blocks = rows * width + 1
        k = torch.randn(hkv, blocks, bs, d, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.arange(rows * width, device=device).view(rows, width)
        lens = torch.full((rows,), context, device=device)
        q = torch.randn(rows, hkv * groups, d, device=device, dtype=torch.bfloat16)
        cells = []
        args_ = (q, k, v, tables, lens, 0.125, torch.bfloat16)
        for tile in (16, 32, 64, 128):
            for warps in (1, 2, 4):
                try:
                    for _ in range(3):  # the first compiles
                        triton_attention.paged_decode(*args_, tile=tile, num_warps=warps)
                    # 50 calls replayed from one graph: the kernels' time, as in a step's graph.
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(50):
                            triton_attention.paged_decode(*args_, tile=tile, num_warps=warps)
                    graph.replay()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    graph.replay()
                    torch.cuda.synchronize()
                    cells.append(f"t{tile}w{warps} {(time.perf_counter() - t0) / 50 * 1e6:.1f}")
                    del graph
                except Exception as e:
                    cells.append(f"t{tile}w{warps} {type(e).__name__}")
        line = f"attention kernel @{rows} rows x {context} keys (us a call): " + ", ".join(cells)
        report.notes.append(line)
        print("  " + line, flush=True)


def run_peer(args: argparse.Namespace, device: torch.device, streams: int, report: Report) -> None:
    """transformers' compiled static-cache ``generate`` over ``streams`` prompts (bf16)."""
    model = build_model(args, torch.bfloat16, device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = torch.tensor(
        make_prompts(streams, args.prompt_tokens, model.config.vocab_size, 1), device=device
    )
    kw = dict(
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        do_sample=False,
        cache_implementation="static",
    )
    times = []
    for _ in range(2):  # the first compiles
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
        sync(device)
        times.append(time.perf_counter() - t0)
    tokens = (out.shape[1] - args.prompt_tokens) * streams
    row = {
        "peer": "transformers generate, static cache, compiled (bf16)",
        "streams": streams,
        "tok_s": tokens / times[-1],
        "first_run_s": times[0],
        "timed_run_s": times[-1],
    }
    report.peer.append(row)
    print(
        f"  peer @{streams}: {row['tok_s']:.1f} tok/s (first run {times[0]:.1f} s incl. compile)",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", default="", help="a converted model directory (config.json)")
    p.add_argument("--random-weights", action="store_true", help="random weights from its config")
    p.add_argument("--tiny", action="store_true", help="a tiny random llama (dry runs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument(
        "--variants",
        nargs="+",
        # What the targets need first; the budget cuts the tail.
        default=[
            "eager-fp32",
            "graphs+compile-bf16",
            "peer",
            "graphs+compile-bf16-no-ahead",
            "graphs+compile-bf16-decode-graphs",
            "graphs-bf16",
            "graphs-fp32",
            "graphs+compile-fp32",
            "graphs-sdpa-bf16",
            "eager-triton-bf16",
            "eager-bf16",
            "reduce-overhead-bf16",
        ],
        choices=[*VARIANTS, "peer"],
        help="in this order; `peer`: transformers' generate at the --peer stream counts",
    )
    p.add_argument("--attention", default="", help="engine.cuda_attention for every variant")
    p.add_argument(
        "--graph-max-tokens",
        type=int,
        default=None,
        help="engine.cuda_graph_max_tokens (default: the setting's); 0 = decode steps only",
    )
    p.add_argument("--sweep", action="store_true", help="time the attention kernel's shapes")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-gib", type=int, default=4, help="engine.kv_cache_bytes in GiB")
    p.add_argument("--peer", type=int, nargs="*", default=[64], help="stream counts for the peer")
    p.add_argument("--budget-s", type=float, default=300.0, help="start nothing after this")
    p.add_argument("--out", default="", help="write the JSON report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = copy_bandwidth_gb_s(device)
    probe = build_model(args, torch.float32, torch.device("cpu"))
    params = sum(p.numel() for p in probe.parameters())
    vocab = probe.config.vocab_size
    weights = "random (seed 0)" if args.tiny or args.random_weights else "the directory's"
    report = Report(
        name,
        torch.__version__,
        transformers.__version__,
        params,
        weights,
        args.prompt_tokens,
        args.max_tokens,
        bw,
    )
    print(
        f"{name}: torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{params / 1e6:.1f}M parameters, {weights} weights; copy {bw:.0f} GB/s; "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} new tokens",
        flush=True,
    )
    if args.sweep:
        attention_sweep(args, device, report)
    context = args.prompt_tokens + args.max_tokens // 2  # a decode step's mean context
    reference: dict[int, list[list[int]]] = {}
    for variant in args.variants:
        if variant == "peer":
            for c in args.peer:
                if time.perf_counter() - start > args.budget_s:
                    report.notes.append(f"peer @{c}: skipped (budget)")
                    continue
                try:
                    run_peer(args, device, c, report)
                except Exception as e:
                    report.notes.append(f"peer @{c}: {type(e).__name__}: {e}")
                    print(f"peer @{c}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        if time.perf_counter() - start > args.budget_s:
            report.notes.append(f"{variant}: skipped (budget)")
            print(f"{variant}: skipped, past the budget", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            engine, model = make_engine(args, variant, device)
            dtype = getattr(torch, VARIANTS[variant][0])
            graphs = engine.runner.graphs
            if graphs is None:  # eager: nothing to capture, first-call costs only
                run_engine(engine, make_prompts(2, args.prompt_tokens, vocab, seed=0), 4)
            for c in args.streams:
                prompts = make_prompts(c, args.prompt_tokens, vocab, seed=c)
                if graphs is not None:  # warm-up: captures the graphs the timed run replays
                    run_engine(engine, prompts, args.max_tokens)
                replays0 = graphs.replays if graphs else 0
                used0 = engine.runner.ahead_used
                run = run_engine(engine, prompts, args.max_tokens)
                wall, steps, step_ms, outputs = (
                    run.wall_s,
                    run.steps,
                    run.median_decode_ms,
                    run.outputs,
                )
                replays = (graphs.replays if graphs else 0) - replays0
                tokens = sum(len(o) for o in outputs)
                roof = c / (decode_step_bytes(model, dtype, c, context) / (bw * 1e9))
                same = ""
                if variant == args.variants[0]:
                    reference[c] = outputs
                elif c in reference:
                    same = f"{sum(a == b for a, b in zip(reference[c], outputs, strict=True))}/{c}"
                level = Level(variant, c, tokens / wall, wall, steps, step_ms, replays, roof, same)
                level.attention = (
                    ("triton" if graphs.triton else "sdpa") if graphs is not None else "eager"
                )
                level.other_steps_ms = sum(run.other_ms)
                level.decode_steps_ms = sum(run.decode_ms)
                level.decode_step_mean_ms = statistics.fmean(run.decode_ms) if run.decode_ms else 0
                report.levels.append(level)
                print(
                    f"  {variant} @{c}: {level.tok_s:.1f} tok/s, decode step {step_ms:.2f} ms "
                    f"(mean {level.decode_step_mean_ms:.2f}), {steps} steps ({replays} replayed, "
                    f"{level.attention}), roofline {roof:.0f} tok/s, "
                    f"same as {args.variants[0]}: {same or '-'}; wall {wall * 1e3:.1f} ms = "
                    f"{len(run.other_ms)} prompt steps {level.other_steps_ms:.1f} + "
                    f"{len(run.decode_ms)} decode steps {level.decode_steps_ms:.1f} + "
                    f"between {wall * 1e3 - level.other_steps_ms - level.decode_steps_ms:.1f}; "
                    f"{engine.runner.ahead_used - used0} steps ran ahead",
                    flush=True,
                )
            try:
                kernels_of_a_step(engine, report.notes)
            except Exception as e:
                print(f"  profile: {type(e).__name__}: {e}", flush=True)
            del engine, model
        except Exception as e:  # one broken variant must not cost the rest of the run
            report.notes.append(f"{variant}: {type(e).__name__}: {e}")
            print(f"{variant}: FAILED {type(e).__name__}: {e}", flush=True)
        print(f"{variant}: {time.perf_counter() - t0:.1f} s", flush=True)
        gc.collect()  # the engine's graphs and their memory pool go with it
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(report, args)
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(report), indent=1))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


def print_table(report: Report, args: argparse.Namespace) -> None:
    print(f"\n{report.device}; copy bandwidth {report.copy_gb_s:.0f} GB/s")
    print(f"| variant | {' | '.join(f'{c} streams' for c in args.streams)} |")
    print(f"| --- |{' ---: |' * len(args.streams)}")
    by = {(lv.variant, lv.streams): lv for lv in report.levels}
    for variant in (v for v in args.variants if v != "peer"):
        cells = []
        for c in args.streams:
            lv = by.get((variant, c))
            cells.append(
                f"{lv.tok_s:.0f} ({lv.decode_step_ms:.2f} ms, {100 * lv.tok_s / lv.roofline_tok_s:.0f}%)"
                if lv
                else "-"
            )
        print(f"| {variant} | {' | '.join(cells)} |")
    print("cells: tok/s over the run (median decode step, % of the decode roofline)")
    roof = {lv.streams: lv.roofline_tok_s for lv in report.levels if lv.variant.endswith("bf16")}
    if roof:
        print(
            "bf16 decode roofline tok/s: "
            + ", ".join(f"{c}: {r:.0f}" for c, r in sorted(roof.items()))
        )
    for row in report.peer:
        c = row["streams"]
        ours = [lv.tok_s for lv in report.levels if lv.streams == c]
        ratio = f", best engine variant {max(ours) / row['tok_s']:.2f}x" if ours else ""
        print(f"peer @{c}: {row['tok_s']:.0f} tok/s{ratio}")
    for note in report.notes:
        print(f"note: {note}")


if __name__ == "__main__":
    raise SystemExit(main())
