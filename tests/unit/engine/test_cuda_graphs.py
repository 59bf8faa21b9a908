"""Decode steps as graphs (libs/engine/cuda_graphs.py) without a GPU: buckets, padding onto the
scratch block, one graph per (rows, width) reused, the device sampler's greedy path, and the
engine's greedy output through the graphs' bookkeeping (``eager_capture``: every replay a
plain call over the graph's own buffers) equal to ``generate``."""

from __future__ import annotations

import os

import pytest
import torch

from bench.support.tiny_models import tiny_model
from libs.engine import triton_attention
from libs.engine.attention import decode_rows
from libs.engine.cuda_graphs import batch_bucket, eager_capture, width_bucket
from libs.engine.engine import LLMEngine
from libs.engine.sampler import Sampler, SamplingRow, device_greedy
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine
from tests.unit.engine.test_invariance import prompts

pytestmark = pytest.mark.unit

# Triton's kernel runs on a GPU, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1).
needs_triton = pytest.mark.skipif(
    not triton_attention.AVAILABLE
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on a GPU, or its interpreter (TRITON_INTERPRET=1)",
)


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere() -> None:
    assert EngineSettings().dtype == "float32"
    assert EngineSettings(device="cuda").dtype == "bfloat16"
    assert EngineSettings(device="cuda:1").dtype == "bfloat16"
    assert EngineSettings(device="cuda", dtype="float32").dtype == "float32"


def test_buckets() -> None:
    sizes = [1, 2, 4, 8, 24]
    assert [batch_bucket(n, sizes) for n in (1, 2, 3, 8, 9, 24, 25)] == [1, 2, 4, 8, 24, 24, None]
    assert [width_bucket(w, 32) for w in (1, 2, 3, 5, 16, 17, 32, 33)] == [
        2,
        2,
        4,
        8,
        16,
        32,
        32,
        None,
    ]


def _engine(model: torch.nn.Module, attention: str = "sdpa") -> LLMEngine:
    settings = engine_settings(
        model,
        num_blocks=64,
        block_size=4,
        max_num_seqs=6,
        cpu_kernels="off",
        cuda_graph_batch_sizes=[1, 2, 4],
        cuda_attention=attention,
        cuda_graph_max_tokens=16,
    )
    return LLMEngine(model, None, settings, "tiny", graph_capture=eager_capture)


@pytest.mark.parametrize(
    ("arch", "attention"),
    [
        ("llama", "sdpa"),
        ("qwen2", "sdpa"),
        pytest.param("llama", "triton", marks=needs_triton),
        pytest.param("qwen2", "triton", marks=needs_triton),
    ],
)
def test_greedy_through_the_graphs_equals_generate(arch: str, attention: str) -> None:
    model = tiny_model(arch)
    ps = prompts()
    refs = [reference_greedy(model, p, 12) for p in ps]
    engine = _engine(model, attention)
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.triton == (attention == "triton")
    # One block beyond the pool's: the padding rows' scratch block.
    assert runner.kv_cache.num_blocks == engine.pool.num_blocks + 1
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(engine, subs)
    for i in range(len(ps)):
        assert results[(f"r{i}", 0)].token_ids == refs[i], f"prompt {i}"
    graphs = runner.graphs
    assert graphs.replays > 0 and not graphs.failed
    # Steps with prompt tokens of up to 16 tokens replayed graphs too; longer ones (up to 32,
    # max_num_batched_tokens) ran eager.
    assert 0 < runner.prompt_graph_steps < graphs.replays
    # Decode steps ran ahead (engine.cuda_run_ahead): launched before the host had the last
    # step's tokens, and used by the next step when it was that one.
    assert 0 < runner.ahead_used <= runner.ahead_launched
    # Up to 6 sequences (max_num_seqs): 3 rows pad to 4, 5 to 6; prompt steps up to 16.
    assert graphs.batch_sizes == [1, 2, 4, 6, 16]
    assert {rows for rows, _ in graphs.graphs} <= {1, 2, 4, 6, 16}
    assert all(w & (w - 1) == 0 for _, w in graphs.graphs)
    # Every sequence's blocks went back; the scratch block was never the pool's to give.
    assert engine.pool.num_free == engine.pool.num_blocks


def test_padding_rows_touch_only_the_scratch_block() -> None:
    engine = _engine(tiny_model("llama"))
    runner = engine.runner
    assert runner.graphs is not None
    cache = runner.kv_cache.data
    scratch = runner.num_blocks
    cache.fill_(0)
    # Three decode rows: a graph of four, one padding row.
    ids, positions, slots = [7, 8, 9], [5, 2, 9], [4 * 1 + 1, 4 * 3 + 2, 4 * 6 + 1]
    tables = [[0, 1], [3], [5, 6, 7]]
    logits = runner.graphs.run(ids, positions, slots, tables)
    assert logits is not None and logits.shape == (3, runner.shape.vocab_size)
    assert (4, 4) in runner.graphs.graphs
    written = cache.abs().sum(dim=(0, 1, 2, 4, 5)).nonzero().flatten().tolist()
    assert written == [1, 3, 6, scratch]
    # The rows' logits equal the eager step's (row by row: no graph holds a single row of
    # width 2 yet, and the eager path has no padding).
    runner.graphs = None
    eager = runner._forward(ids, positions, slots, [0, 1, 2], tables, [0, 1, 2])
    assert torch.allclose(logits, eager, atol=1e-5)


def test_a_graph_is_captured_once_and_replayed() -> None:
    calls = 0

    def counting(fn):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return eager_capture(fn)

    model = tiny_model("llama")
    settings = engine_settings(
        model, cpu_kernels="off", cuda_graph_batch_sizes=[2, 8], cuda_graph_max_tokens=0
    )
    engine = LLMEngine(model, None, settings, "tiny", graph_capture=counting)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    run_engine(engine, [Submission(f"r{i}", [1, 2, 3, i], greedy) for i in range(2)])
    assert engine.runner.graphs is not None
    # Captured at start: (2, 2) and (8, 2). Two sequences of 4 + 6 tokens over blocks of 4:
    # widths 2 (the start's graph) then 3 (bucket 4).
    assert sorted(engine.runner.graphs.graphs) == [(2, 2), (2, 4), (8, 2)]
    assert calls == 3
    assert engine.runner.graphs.replays == 5


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("triton", marks=needs_triton)])
def test_a_step_with_prompt_tokens_replays_a_graph_with_the_eager_logits(attention: str) -> None:
    engine = _engine(tiny_model("llama"), attention)
    runner = engine.runner
    assert runner.graphs is not None and runner.graph_max_tokens == 16
    # Sequence 0: a 3-token prompt chunk at positions 4..6 (blocks 0, 1), after 4 computed
    # tokens; sequence 1: one decode token at position 5 (blocks 3, 4). Sampled: the chunk's
    # last token and the decode token. Then the same sequences' next step.
    ids, positions = [11, 12, 13, 14], [4, 5, 6, 5]
    slots = [4 * 1 + 0, 4 * 1 + 1, 4 * 1 + 2, 4 * 4 + 1]
    tables, entry, keep = [[0, 1], [3, 4]], [0, 0, 0, 1], [2, 3]
    cache = runner.kv_cache.data
    cache.normal_()  # the prompt's first 4 tokens' K/V: anything, the same for both runs
    before = cache.clone()
    graphed = runner._forward(ids, positions, slots, keep, tables, entry).clone()
    assert runner.prompt_graph_steps == 1 and (4, 2) in runner.graphs.graphs
    after_graph = cache.clone()
    cache.copy_(before)
    graphs, runner.graphs = runner.graphs, None
    eager = runner._forward(ids, positions, slots, keep, tables, entry)
    assert graphed.shape == eager.shape == (2, runner.shape.vocab_size)
    # Float32 matmuls over the graph's padded rows round differently from the eager batch's
    # where the BLAS picks another blocking for the other row count (AVX-512: up to 7.6e-6 on
    # values up to ~15 in the second layer's K/V, a few ulps); a misplaced row is off by O(1).
    assert torch.allclose(graphed, eager, atol=1e-5, rtol=1e-5)
    # The same K/V landed in the same slots (the padding rows' only in the scratch block).
    scratch = runner.num_blocks
    graph_kv, eager_kv = after_graph[:, :, :, :scratch], cache[:, :, :, :scratch]
    assert torch.allclose(graph_kv, eager_kv, atol=1e-5, rtol=1e-5)
    # A step of more tokens than engine.cuda_graph_max_tokens runs eager.
    runner.graphs = graphs
    n = 17
    long_step = runner._graph_step(
        [1] * n, list(range(n)), list(range(n)), [n - 1], [[0, 1, 2, 3, 4]], [0] * n
    )
    assert long_step is None and runner.prompt_graph_steps == 1


def test_running_ahead_changes_no_output() -> None:
    """Steps launched ahead are used only when the next step is theirs: with a request that
    stops on a token between two others, one aborted, one arriving mid-run, one sampling and
    lengths that end at different steps, the outputs equal those of the same engine without
    running ahead, and both the used and the dropped cases happen."""
    model = tiny_model("llama")
    ps = prompts()
    greedy = dict(temperature=0.0, ignore_eos=True)
    # r0's 5th greedy token, as a stop token for r1 (the same prompt): unknown in advance.
    stop_at = reference_greedy(model, ps[0], 8)[4]
    subs = [
        Submission("r0", ps[0], SamplingParams(max_tokens=14, **greedy)),
        Submission("r1", ps[0], SamplingParams(max_tokens=20, stop_token_ids=[stop_at], **greedy)),
        Submission("r2", ps[4], SamplingParams(max_tokens=30, **greedy)),
        Submission("r3", ps[8], SamplingParams(max_tokens=16, **greedy)),
        Submission("r4", ps[1], SamplingParams(max_tokens=9, **greedy), arrive_at_step=16),
        Submission(
            "r5", ps[9], SamplingParams(max_tokens=6, temperature=0.8, seed=3), arrive_at_step=20
        ),
    ]

    def serve(ahead: bool) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = _engine(model)
        engine.settings.cuda_run_ahead = ahead
        pending = list(subs)
        out: dict[str, list[int]] = {}
        step = 0
        while pending or engine.has_unfinished():
            while pending and pending[0].arrive_at_step <= step:
                sub = pending.pop(0)
                engine.add_request(sub.request_id, sub.prompt, sub.sampling)
            if step == 9:
                engine.abort_request("r2")  # a row between others
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.chunk.token_ids)
            step += 1
            assert step < 1_000
        assert engine.pool.num_free == engine.pool.num_blocks
        return out, engine

    plain, off = serve(False)
    ahead, on = serve(True)
    assert off.runner.ahead_launched == 0
    assert ahead == plain
    assert plain["r1"][-1] == stop_at and len(plain["r1"]) == 5
    assert [len(plain[r]) for r in ("r0", "r3", "r4", "r5")] == [14, 16, 9, 6]
    assert len(plain["r2"]) < 30
    runner = on.runner
    assert 0 < runner.ahead_used < runner.ahead_launched


def test_device_greedy_equals_the_sampler() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    greedy = SamplingParams(temperature=0.0)
    plain = [SamplingRow(greedy, None, [1, 2], {}) for _ in range(5)]
    host = Sampler(seed=0)(logits, plain).token_ids
    assert device_greedy(logits, plain) == host == logits.argmax(-1).tolist()
    # Anything beyond a plain arg-max goes to the full sampler.
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias={"3": 5.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ):
        rows = [*plain[:4], SamplingRow(params, None, [1, 2], {})]
        assert device_greedy(logits, rows) is None


def test_a_graph_that_does_not_capture_leaves_the_engine_eager() -> None:
    def broken(fn):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_model("llama")
    ps = prompts()[:3]
    refs = [reference_greedy(model, p, 6) for p in ps]
    settings = engine_settings(model, cpu_kernels="off")
    engine = LLMEngine(model, None, settings, "tiny", graph_capture=broken)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = run_engine(engine, [Submission(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    assert [results[(f"r{i}", 0)].token_ids for i in range(3)] == refs
    assert engine.runner.graphs is not None and engine.runner.graphs.failed


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_the_gather_and_sdpa(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hkv, groups, d, bs, blocks, width = 3, 3, 64, 16, 40, 8
    k = torch.randn(hkv, blocks, bs, d, device=device).to(dtype)
    v = torch.randn(hkv, blocks, bs, d, device=device).to(dtype)
    lens = torch.tensor([1, 16, 17, 50, 100, 128], device=device)
    tables = torch.stack([torch.randperm(blocks, device=device)[:width] for _ in lens])
    q = torch.randn(hkv * groups, len(lens), d, device=device)  # [H, B, D]
    out = triton_attention.paged_decode(q.transpose(0, 1), k, v, tables, lens, 0.125)
    key_pos = torch.arange(width * bs, device=device)
    mask = (key_pos[None, :] < lens[:, None])[None, :, None, :]
    ref = decode_rows(q, k, v, None, tables.reshape(-1), mask, 0.125)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kv_write_equals_the_index_copies(dtype: torch.dtype) -> None:
    from libs.engine.attention import write_kv

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hkv, d, bs, blocks, t = 3, 64, 16, 10, 7
    # The step's K/V as the model hands them: [1, Hkv, T, D] views, float32 into `dtype`.
    key = torch.randn(1, t, hkv, d, device=device).transpose(1, 2)[0]
    value = torch.randn(1, t, hkv, d, device=device).transpose(1, 2)[0]
    slots = torch.tensor([0, 5, 17, 18, 100, 159, 33], device=device)
    ours = [torch.zeros(hkv, blocks, bs, d, device=device, dtype=dtype) for _ in range(2)]
    ref = [c.clone() for c in ours]
    triton_attention.write_kv(ours[0], ours[1], slots, key, value)
    write_kv(ref[0], ref[1], slots, key, value)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert ours[0].abs().sum() > 0
