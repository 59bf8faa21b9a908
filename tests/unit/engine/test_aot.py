"""``engine.compile_aot``: the compiled forward's graphs are saved once and loaded by later
engines, serve whichever weights they are loaded with, and a file that does not load or does
not fit is compiled again, never run."""

from __future__ import annotations

import os
import shutil
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
