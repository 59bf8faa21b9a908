"""A restarted worker's first steps on graphs saved by another process, in a process of its own.

``python -m tests.unit.engine.aot_restart DIR NUM_BLOCKS`` builds the tiny llama of
``test_aot.py`` over a KV cache of ``NUM_BLOCKS`` blocks, loads the graphs saved under DIR,
and serves each scenario of :data:`SCENARIOS` on a fresh engine with every guard of the loaded
graphs checked at every step (a step a graph does not fit raises). It prints one JSON line:
per scenario, whether both graphs were loaded (none compiled), the steps that ran compiled
and the forwards run, and whether the tokens equal ``generate``'s. Run by
``test_aot.py::test_saved_graphs_fit_every_first_step_a_restart_meets``.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch

from bench.support.tiny_models import TINY_VOCAB, tiny_model
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import SpeculativeSettings
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine

MAX_NEW = 6
SEED = 3  # the model test_aot.py compiles the graphs with
# The tokens a request held during the restart, a migrated stream (its prompt and the tokens
# streamed before the kill, replayed: decision 0012) and a prompt the n-gram proposer finds
# proposals in.
SHORT = [5, 9, 2, 7, 7, 3, 1]
LONG = [(7 * i) % TINY_VOCAB for i in range(301)]  # 76 blocks of 4: a wide block table
EVERY_TOKEN = list(range(TINY_VOCAB))  # n-grams of one token find a proposal at every step

SCENARIOS: dict[str, list[tuple[list[int], int]]] = {  # (prompt, arrives at step)
    "one held request": [(SHORT, 0)],
    "several at once": [(SHORT, 0), (SHORT[::-1], 0), ([11] * 23, 0), ([3, 4], 0)],
    "a migrated stream with a long context": [(LONG, 0)],
    "a prompt chunk beside decode rows": [(SHORT, 0), ([12] * 9, 0), (LONG[:40], 3)],
    "the speculative verify step": [(EVERY_TOKEN, 0)],
}


def serve(settings: Any, name: str, refs: dict[tuple[int, ...], list[int]]) -> dict[str, Any]:
    """One scenario on a fresh engine (its own warm-up, as a restarted worker's) over a fresh
    copy of the model (an engine switches its model to paged attention)."""
    if name == "the speculative verify step":
        settings = settings.model_copy(
            update={
                "speculative": SpeculativeSettings(
                    method="ngram", prompt_lookup_min=1, prompt_lookup_max=2
                )
            }
        )
    engine = LLMEngine(tiny_model("llama", seed=SEED), None, settings, "restart")
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    scenario = SCENARIOS[name]
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=at) for i, (p, at) in enumerate(scenario)]
    results = run_engine(engine, subs)
    exact = all(results[(s.request_id, 0)].token_ids == refs[tuple(s.prompt)] for s in subs)
    runner, aot = engine.runner, engine.runner.aot
    assert aot is not None
    return {
        "loaded": sorted(aot.loaded),
        "compiled_steps": runner.compiled_steps,
        "forwards": engine.num_steps + 2,  # the two warm-up forwards
        "exact": exact,
        "proposed": engine.speculator.num_proposed if engine.speculator is not None else 0,
    }


def main(directory: str, num_blocks: int) -> None:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    # Every step checks every guard of the loaded graphs (the runner checks only the first).
    AOTCompiledFunction.disable_guard_check = lambda self: None  # type: ignore[method-assign]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # what the graphs did
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=SEED)
    prompts = {tuple(p) for scenario in SCENARIOS.values() for p, _ in scenario}
    refs = {p: reference_greedy(model, list(p), MAX_NEW) for p in prompts}
    settings = engine_settings(
        model, num_blocks=num_blocks, cpu_kernels="on", compile=True, compile_dir=directory
    )
    out = {name: serve(settings, name, refs) for name in SCENARIOS}
    out["graphs compiled"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
