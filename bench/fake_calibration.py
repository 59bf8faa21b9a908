"""Calibrate the FAKE engine to the real worker on this machine: ``python -m bench.fake_calibration``.

Builds the engine a real worker builds (the settings' model, weight format, kernels, threads and
compile flag; ``STRAIT_ENGINE__COMPILE=false`` for the eager one) and measures, on the engine
alone (no NATS):

- a **decode step** against the rows it runs: ``rows`` requests decoding together, the median
  step with no prefill in it (the fastest of ``--repeats`` runs), at each of ``--rows``; fitted as ``step = a + b x rows``;
- a **prefill** against the prompt's length: one request of ``n`` tokens at each of
  ``--prompt-tokens``, the step that computes it; fitted as ``prefill = c x n`` (+ its own
  intercept, printed, not used: the fake's prefill has none).

It prints the table and the ``[fake_engine]`` lines that make the FAKE engine cost the same
(``per_token_s`` = a + b: one row's step; ``per_row_s`` = b; ``per_prompt_token_s`` = c), the
values configs/fake-calibrated.toml carries. A FAKE worker sleeps instead of computing, so on
this machine it costs no core: adding one adds the capacity a real worker would add on a
machine with a core for it (docs/autoscaling.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import numpy as np

from bench.engine import make_prompts


def decode_step_s(engine: Any, prompts: list[list[int]], tokens: int) -> float:
    """Median seconds of the decode-only steps while ``len(prompts)`` rows run together."""
    from libs.protocol import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"cal-{len(prompts)}-{i}-{time.perf_counter()}", p, params)
    steps = []
    while engine.has_unfinished():
        prefilling = (
            any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.num_waiting
        )
        t = time.perf_counter()
        engine.step()
        if not prefilling and len(engine.scheduler.running) == len(prompts):
            steps.append(time.perf_counter() - t)
    return statistics.median(steps)


def prefill_s(engine: Any, prompt: list[int]) -> float:
    """Seconds of the step(s) that compute one prompt and sample its first token."""
    from libs.protocol import SamplingParams

    engine.add_request(f"cal-p-{time.perf_counter()}", prompt, SamplingParams(max_tokens=1))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fake_calibration", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", default="1,4,8,16,32", help="decode rows, comma-separated")
    p.add_argument("--prompt-tokens", default="32,128,256", help="prompt lengths")
    p.add_argument("--tokens", type=int, default=24, help="decode steps per rows level")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs per point; the fastest is kept (on a shared machine other work only slows)",
    )
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from libs.engine.engine import LLMEngine
    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.settings import get_settings

    settings = get_settings()
    if settings.engine.num_threads:
        torch.set_num_threads(settings.engine.threads())
    rows = [int(x) for x in args.rows.split(",") if x]
    lengths = [int(x) for x in args.prompt_tokens.split(",") if x]
    es = settings.engine.model_copy()
    es.max_num_seqs = max(es.max_num_seqs, max(rows))
    path = prepare_model(args.model, settings)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    engine = LLMEngine(load_model(path, es), tokenizer, es, args.model)
    warm = make_prompts(tokenizer, 2, 64, tag="Warm-up. ")
    decode_step_s(engine, warm, 4)

    step_ms = {}
    for r in rows:
        runs = [
            decode_step_s(engine, make_prompts(tokenizer, r, 64, tag=f"R{r}x{k}. "), args.tokens)
            for k in range(args.repeats)
        ]
        step_ms[r] = min(runs) * 1e3
        print(f"decode step, {r:>3} rows: {step_ms[r]:7.2f} ms", flush=True)
    pre_ms = {}
    for n in lengths:
        runs = [
            prefill_s(engine, make_prompts(tokenizer, 1, n, tag=f"P{n}x{k}. ")[0])
            for k in range(args.repeats)
        ]
        pre_ms[n] = min(runs) * 1e3
        print(f"prefill, {n:>4} tokens: {pre_ms[n]:7.2f} ms", flush=True)

    b, a = np.polyfit(list(step_ms), list(step_ms.values()), 1)
    c, c0 = np.polyfit(list(pre_ms), list(pre_ms.values()), 1)
    print()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"{torch.get_num_threads()} torch threads, {args.model}, "
        f"compile={'on' if engine.runner.compiling else 'off'}, weights "
        f"{engine.runner.weights_summary()}"
    )
    print(f"# decode step = {a:.3f} ms + {b:.3f} ms x rows; prefill = {c0:.2f} ms + {c:.4f} ms x n")
    print("[fake_engine]")
    print(f"per_token_s = {(a + b) / 1e3:.5f}")
    print(f"per_row_s = {b / 1e3:.6f}")
    print(f"per_prompt_token_s = {c / 1e3:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
