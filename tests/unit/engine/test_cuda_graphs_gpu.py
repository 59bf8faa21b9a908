"""Decode steps as CUDA graphs on a real device: greedy float32 output through the captured
graphs (eager and compiled forward) equal to ``generate``, bf16 by ``dtype = "auto"``, and the
sampler's arg-max on the device. Marked ``gpu``: they run where CUDA is (never in CI); the
same bookkeeping runs on a CPU in ``test_cuda_graphs.py``."""

from __future__ import annotations

import pytest
import torch

from bench.support.tiny_models import tiny_model
from libs.engine.engine import LLMEngine
from libs.engine.sampler import Sampler, SamplingRow
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine
from tests.unit.engine.test_invariance import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # inductor's advice for float32 matmuls on tensor cores (the contract is full float32)
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores"),
]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _serve(engine: LLMEngine, ps: list[list[int]]) -> list[list[int]]:
    subs = [Submission(f"r{i}", p, GREEDY, arrive_at_step=i) for i, p in enumerate(ps)]
    results = run_engine(engine, subs)
    return [results[(f"r{i}", 0)].token_ids for i in range(len(ps))]


@pytest.mark.parametrize(
    ("arch", "attention", "compile"),
    [
        ("llama", "triton", False),
        ("qwen2", "triton", False),
        ("llama", "sdpa", False),
        ("qwen2", "sdpa", False),
        ("llama", "triton", True),
        ("llama", "sdpa", True),
    ],
)
def test_float32_greedy_through_cuda_graphs_equals_generate(
    arch: str, attention: str, compile: bool
) -> None:
    model = tiny_model(arch).cuda()
    ps = prompts()
    refs = [reference_greedy(model, p, 12) for p in ps]
    settings = engine_settings(
        model,
        device="cuda",
        dtype="float32",
        compile=compile,
        max_num_seqs=6,
        cuda_attention=attention,
    )
    engine = LLMEngine(model, None, settings, "tiny")
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.triton == (attention == "triton")
    assert _serve(engine, ps) == refs
    # Every decode step replayed a graph (none failed to capture and fell back to eager), and
    # decode steps ran ahead of the host (engine.cuda_run_ahead) with the same answers.
    assert graphs.replays > 0 and not graphs.failed
    assert engine.runner.ahead_used > 0


def test_dtype_auto_serves_bfloat16_through_the_graphs() -> None:
    model = tiny_model("llama")
    settings = engine_settings(model, device="cuda")
    assert settings.dtype == "bfloat16"
    engine = LLMEngine(model.to("cuda", torch.bfloat16), None, settings, "tiny")
    assert engine.runner.kv_cache.data.dtype == torch.bfloat16
    outs = _serve(engine, prompts())
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.triton and graphs.replays > 0 and not graphs.failed
    assert all(len(o) == 12 and all(0 <= t < model.config.vocab_size for t in o) for o in outs)


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_graphs_off_runs_eager(attention: str) -> None:
    model = tiny_model("llama").cuda()
    ps = prompts()
    refs = [reference_greedy(model, p, 12) for p in ps]
    settings = engine_settings(
        model, device="cuda", dtype="float32", cuda_graphs=False, cuda_attention=attention
    )
    engine = LLMEngine(model, None, settings, "tiny")
    assert engine.runner.graphs is None
    assert engine.runner.row_attention == (attention == "triton")
    assert _serve(engine, ps) == refs


def test_sampler_on_cuda_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, [1], {}) for _ in range(6)]
    mixed = [*rows[:5], SamplingRow(SamplingParams(temperature=0.0, logprobs=2), None, [1], {})]
    sampler = Sampler(seed=0)
    for rs in (rows, mixed):
        assert sampler(logits.cuda(), rs).token_ids == sampler(logits, rs).token_ids
    assert EngineSettings(device="cuda").cuda_graphs


def test_the_whole_sampler_runs_on_the_device_with_the_hosts_answers() -> None:
    """Bias, penalties, sampling (seeded: the same draws as on the host), min-p, top-k/top-p
    and log-probabilities on CUDA logits: the CPU's tokens and log-probabilities, and no
    [S, vocab] copy to the host."""
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(7, vocab) * 3

    def row(seed: int | None, **kw: object) -> SamplingRow:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return SamplingRow(SamplingParams(**kw), gen, [1, 5, 9, 5], {5: 2, 9: 1})

    def rows() -> list[SamplingRow]:
        return [
            row(None, temperature=0.0),
            row(1, temperature=0.8, top_p=0.9),
            row(2, temperature=1.2, top_k=20, logprobs=3),
            row(3, temperature=0.7, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.3),
            row(None, temperature=0.0, repetition_penalty=1.3, logprobs=2),
            row(4, temperature=1.0, logit_bias={"7": 100.0}),
            row(5, temperature=0.9, top_k=5, top_p=0.5),
        ]

    host = Sampler(seed=0)(logits, rows())
    copies: list[tuple[int, ...]] = []
    real_to = torch.Tensor.to

    def watch_to(self: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        out = real_to(self, *args, **kw)
        if self.is_cuda and not out.is_cuda:
            copies.append(tuple(self.shape))
        return out

    torch.Tensor.to = watch_to  # type: ignore[method-assign,assignment]
    try:
        dev = Sampler(seed=0)(logits.cuda(), rows())
    finally:
        torch.Tensor.to = real_to  # type: ignore[method-assign]
    assert dev.token_ids == host.token_ids
    assert dev.token_ids[5] == 7
    for a, b in zip(dev.logprobs, host.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.top_ids == b.top_ids and a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < 1e-4
    assert all(vocab not in shape for shape in copies)
