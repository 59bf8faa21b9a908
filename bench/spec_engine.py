"""Speculation on vs off on a real model, the engine alone (no fleet), on any device.

    .venv/bin/python -m bench.spec_engine --workload code --concurrency 1 8 --num-requests 8
    python3 -m bench.spec_engine --model-dir DIR --device cuda --dtype bfloat16   # a GPU

Each concurrency level serves the same requests of a ``bench.workloads`` workload (its chat
prompts through the model's chat template, greedy, the workload's output lengths) with
``engine.speculative.method`` off and then ``--method`` (``ngram`` or ``suffix``) at ``--depth``,
keeping ``c`` requests in flight (a new one joins as one finishes). Printed per run: output tokens/s over the run
(prefill included), engine steps, proposals kept / made, and how many outputs equal the run
without speculation. The served figure is ``strait bench serve`` (docs/speculation.md); this
one isolates the engine, and runs where the fleet does not (a lent GPU).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from bench.workloads import WORKLOADS, generate
from libs.protocol import SamplingParams


@dataclass(slots=True)
class Run:
    method: str
    tokens: int
    wall_s: float
    steps: int
    proposed: int
    kept: int
    outputs: list[list[int]]


def serve(
    engine: Any, method: str, prompts: list[list[int]], lengths: list[int], concurrency: int
) -> Run:
    """Every prompt through ``engine``, ``concurrency`` at a time; greedy, ``ignore_eos``."""
    outputs: list[list[int]] = [[] for _ in prompts]
    todo = deque(range(len(prompts)))
    live = 0
    steps0 = engine.num_steps
    sp = engine.speculator
    p0, k0 = (sp.num_proposed, sp.num_accepted) if sp else (0, 0)
    t0 = time.perf_counter()
    while todo or engine.has_unfinished():
        while todo and live < concurrency:
            i = todo.popleft()
            greedy = SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i], greedy)
            live += 1
        for out in engine.step():
            i = int(out.request_id[1:])
            outputs[i] += out.chunk.token_ids
            if out.request_finished:
                live -= 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    p1, k1 = (sp.num_proposed, sp.num_accepted) if sp else (0, 0)
    return Run(
        method,
        sum(len(o) for o in outputs),
        wall,
        engine.num_steps - steps0,
        p1 - p0,
        k1 - k0,
        outputs,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model of the registry")
    p.add_argument("--model-dir", default="", help="a converted model directory instead")
    p.add_argument("--workload", default="code", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=0, help="0: the workload's lengths")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--depth", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix"], help="the proposer")
    p.add_argument("--device", default="", help="engine.device (default: the settings')")
    p.add_argument("--dtype", default="", help="engine.dtype (default: the settings')")
    p.add_argument("--quantization", default="", help="engine.quantization")
    p.add_argument("--compile", choices=["on", "off"], default="", help="engine.compile")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the workers')")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--distinct",
        action="store_true",
        help="drop requests that repeat an earlier one (the suffix proposer would copy its answer)",
    )
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from libs.engine.engine import LLMEngine
    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.settings import get_settings

    settings = get_settings()
    torch.set_num_threads(args.threads or settings.engine.threads() or torch.get_num_threads())
    path = args.model_dir or str(prepare_model(args.model, settings))
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    requests = generate(args.workload, args.num_requests, args.seed)
    if args.distinct:
        first: dict[tuple[str | None, str], Any] = {}  # (system, user) -> its first request
        for r in requests:
            first.setdefault((r.system, r.user), r)
        requests = list(first.values())
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(r.messages(), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for r in requests
    ]
    lengths = [args.max_tokens or r.max_tokens for r in requests]

    base = settings.engine.model_copy(deep=True)
    for name in ("device", "dtype", "quantization"):
        if getattr(args, name):
            setattr(base, name, getattr(args, name))
    if args.compile:
        base.compile = args.compile == "on"
    base.max_num_seqs = max(base.max_num_seqs, max(args.concurrency))
    print(
        f"{path}: {base.device} {base.dtype} quantization={base.quantization} "
        f"compile={base.compile}, {torch.get_num_threads()} threads; {args.workload}, "
        f"{len(prompts)} requests, {sum(lengths)} output tokens",
        flush=True,
    )
    engines = {}
    for method in ("off", args.method):
        s = base.model_copy(deep=True)
        s.speculative.method = method  # type: ignore[assignment]
        s.speculative.num_speculative_tokens = args.depth
        # A model each: the engine packs and fuses its model's layers as it starts.
        engines[method] = LLMEngine(load_model(path, s), tokenizer, s, args.model)
        # Warm-up: first-call costs stay out of the runs.
        serve(engines[method], method, prompts[:1], [4], 1)

    header = (
        f"{'streams':>7} {'method':>6} {'tok/s':>8} {'steps':>6} {'kept/made':>11} "
        f"{'on/off':>7} {'same as off':>11}"
    )
    print(header)
    for c in args.concurrency:
        off = serve(engines["off"], "off", prompts, lengths, c)
        on = serve(engines[args.method], args.method, prompts, lengths, c)
        same = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True))
        for r in (off, on):
            rate = r.tokens / r.wall_s
            ratio = rate / (off.tokens / off.wall_s)
            print(
                f"{c:>7} {r.method:>6} {rate:>8.1f} {r.steps:>6} "
                f"{f'{r.kept}/{r.proposed}':>11} {ratio:>6.2f}x {f'{same}/{len(prompts)}':>11}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
