"""``engine.compile_aot``: the compiled forward's graphs are saved once and loaded by later
engines, serve whichever weights they are loaded with, and a file that does not load or does
not fit is compiled again, never run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.support.tiny_models import TINY_VOCAB, tiny_model
from libs.engine import aot
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import SpeculativeSettings
from tests.unit.engine import aot_restart
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine

pytestmark = pytest.mark.unit

MAX_NEW = 8
PROMPTS = [[5, 9, 2], [7] * 11, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def _engine(model: torch.nn.Module, cache: Path, name: str) -> LLMEngine:
    settings = engine_settings(model, cpu_kernels="on", compile=True, compile_dir=str(cache))
    return LLMEngine(model, None, settings, name)


def _answers(engine: LLMEngine, tag: str) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"{tag}{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    results = run_engine(engine, subs)
    return [results[(f"{tag}{i}", 0)].token_ids for i in range(len(PROMPTS))]


def _graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _aot(engine: LLMEngine) -> aot.AotForward:
    assert engine.runner.aot is not None
    return engine.runner.aot


def test_a_later_engine_loads_the_graphs_and_answers_with_its_own_weights(tmp_path: Path) -> None:
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=5)
    refs = [[reference_greedy(m, p, MAX_NEW) for p in PROMPTS] for m in (first, second)]
    assert refs[0] != refs[1]

    compiled = _graphs_compiled()
    a = _engine(first, tmp_path, "a")
    assert _aot(a).loaded == set()
    assert _graphs_compiled() == compiled + 2
    key = _aot(a).key
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [f"{key}-many.pt", f"{key}-one.pt"]

    b = _engine(second, tmp_path, "b")  # same structure, other weights: the same graphs
    assert _aot(b).key == key
    assert _aot(b).loaded == {True, False}
    assert _graphs_compiled() == compiled + 2  # nothing traced again
    assert _answers(b, "b") == refs[1]
    assert _answers(a, "a") == refs[0]
    assert b.runner.compiled_shape_classes == {True, False}


def test_a_graph_that_does_not_load_or_does_not_fit_is_compiled_again(tmp_path: Path) -> None:
    model = tiny_model("qwen2", seed=2)
    refs = [reference_greedy(model, p, MAX_NEW) for p in PROMPTS]
    first = _aot(_engine(model, tmp_path, "a"))
    one, many = first.path(True), first.path(False)
    # The several-token graph where the one-token graph belongs: it loads, its guards refuse.
    shutil.copy(many, one)
    shutil.copy(many.with_suffix(".json"), one.with_suffix(".json"))
    many.write_bytes(b"not a graph")  # does not load at all

    compiled = _graphs_compiled()
    again = _engine(model, tmp_path, "b")
    assert _aot(again).loaded == set()
    assert _graphs_compiled() == compiled + 2
    assert _answers(again, "b") == refs
    # The rebuilt files replaced the bad ones.
    assert _aot(_engine(model, tmp_path, "c")).loaded == {True, False}


def test_the_key_changes_with_what_shapes_the_graph_and_only_that() -> None:
    model = tiny_model("llama")
    settings = engine_settings(model, cpu_kernels="on", compile=True)
    key = aot.graph_key(model, settings)
    assert aot.graph_key(tiny_model("llama", seed=9), settings) == key  # weights are inputs
    same: dict[str, Any] = {
        "kv_cache_bytes": 2 * (settings.kv_cache_bytes or 1),
        "compile_dir": "/elsewhere",
        "speculative": SpeculativeSettings(method="suffix", num_speculative_tokens=4),
    }
    assert aot.graph_key(model, settings.model_copy(update=same)) == key
    for changed in ({"quantization": "int8"}, {"num_threads": 3}, {"fuse_projections": False}):
        assert aot.graph_key(model, settings.model_copy(update=changed)) != key, changed
    assert aot.graph_key(tiny_model("qwen2"), settings) != key
    assert aot.graph_key(tiny_model("llama", vocab_size=TINY_VOCAB + 8), settings) != key


def test_graphs_unused_for_two_weeks_are_pruned_and_loaded_ones_kept(tmp_path: Path) -> None:
    old, used = tmp_path / "old-one.pt", tmp_path / "used-one.pt"
    for f in (old, used):
        f.write_bytes(b"graph")
        f.with_suffix(".json").write_text("{}")
        past = time.time() - aot.UNUSED_GRAPH_MAX_AGE_S - 60
        os.utime(f, (past, past))
    os.utime(used)  # what a load does
    assert aot.prune(tmp_path) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used-one.json", "used-one.pt"]


def test_saved_graphs_fit_every_first_step_a_restart_meets(tmp_path: Path) -> None:
    """Graphs saved by one process serve, in a fresh process, every first step a restarted
    worker can meet (one held request, several at once, a migrated stream's long context, a
    prompt chunk beside decode rows, the speculative verify step) with every guard checked at
    every step and nothing compiled. The fresh process's cache is 2048 blocks of 1 KiB: a
    2 MiB-multiple mapping the kernel aligns, which put the cache at storage offset 0, where
    the saved graphs' guards (``2 <= offset``) refused it."""
    model = tiny_model("llama", seed=aot_restart.SEED)
    _engine(model, tmp_path, "compile")  # compiles and saves both graphs (256 blocks)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.engine.aot_restart", str(tmp_path), "2048"],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("graphs compiled") == 0, out
    assert set(out) == set(aot_restart.SCENARIOS)
    for name, r in out.items():
        assert r["loaded"] == [False, True], (name, r)
        assert r["compiled_steps"] == r["forwards"], (name, r)  # no step ran eager
        assert r["exact"], (name, r)
    assert out["the speculative verify step"]["proposed"] > 0


def test_a_graph_compiles_in_the_background_while_steps_run_eager(tmp_path: Path) -> None:
    """With ``engine.compile_background`` an engine with no saved graph serves at once: its
    steps run eager (the beat says "compiling") while the graphs compile on a thread, and
    the steps after the compile run them; answers never change."""
    model = tiny_model("llama", seed=4)
    refs = [reference_greedy(model, p, MAX_NEW) for p in PROMPTS]
    settings = engine_settings(
        model, cpu_kernels="on", compile=True, compile_dir=str(tmp_path), compile_background=True
    )
    engine = LLMEngine(model, None, settings, "bg")
    runner = engine.runner
    assert runner.forward_kind == "compiling" and runner.compiled_steps == 0
    assert _answers(engine, "eager") == refs
    assert _aot(engine).wait(timeout_s=600)
    assert runner.forward_kind == "compiling"  # compiled; swapped in by the next step
    before = runner.compiled_steps
    assert _answers(engine, "compiled") == refs
    # A lone sequence's decode steps: the one-token class, whatever the batch above ran.
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    alone = run_engine(engine, [Submission("alone", PROMPTS[0], greedy)])
    assert alone[("alone", 0)].token_ids == refs[0]
    assert runner.forward_kind == "compiled"
    assert runner.compiled_steps > before and runner.compiled_shape_classes == {True, False}
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [
        f"{_aot(engine).key}-many.pt",
        f"{_aot(engine).key}-one.pt",
    ]
