"""The engine's contract on tiny random-weight models: serving optimisations never change the
answer. Greedy fp32 tokens equal ``model.generate(do_sample=False)`` whatever the arrival order,
chunking, prefix hits and preemptions; seeded sampling is reproducible whatever the batch."""

from __future__ import annotations

import random

import pytest
import torch

from bench.support.tiny_models import TINY_VOCAB, tiny_model
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine

pytestmark = pytest.mark.unit

MAX_NEW = 12


def prompts(seed: int = 0) -> list[list[int]]:
    """10 prompts: 6 share a 20-token 'system prompt', lengths split across chunks/blocks."""
    rng = random.Random(seed)
    system = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    out = []
    for i, n in enumerate([3, 9, 17, 30, 5, 41, 12, 26, 1, 8]):
        tail = [rng.randrange(TINY_VOCAB) for _ in range(n)]
        out.append(system + tail if i % 5 < 3 else tail)
    return out


# (engine.cpu_kernels, engine.compile): torch's kernels, Strait's, Strait's under torch.compile
# (qwen2 brings biased projections; mistral's layers are llama's, so its compile adds nothing).
MODES = [("off", False), ("on", False), ("on", True)]


@pytest.mark.parametrize(
    ("arch", "cpu_kernels", "compile"),
    [
        (arch, kern, comp)
        for arch in ["llama", "qwen2", "mistral"]
        for kern, comp in MODES
        if not (comp and arch == "mistral")
    ],
)
def test_greedy_matches_generate_with_chunks_prefix_hits_and_preemption(
    arch: str, cpu_kernels: str, compile: bool
) -> None:
    model = tiny_model(arch)
    ps = prompts()
    refs = [reference_greedy(model, p, MAX_NEW) for p in ps]
    # 24 blocks of 4 tokens: far less than 10 sequences need at once → preemption.
    settings = engine_settings(
        model,
        num_blocks=24,
        block_size=4,
        prefill_chunk_tokens=8,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        cpu_kernels=cpu_kernels,
        compile=compile,
    )
    engine = LLMEngine(model, None, settings, "tiny")
    assert (engine.runner.kernels is not None) == (cpu_kernels == "on")
    assert engine.runner.compiling == compile
    forwards = 0
    execute = engine.runner.execute

    def counted(batch):  # type: ignore[no-untyped-def]
        nonlocal forwards
        forwards += 1
        return execute(batch)

    engine.runner.execute = counted  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(engine, subs)
    for i in range(len(ps)):
        r = results[(f"r{i}", 0)]
        assert r.token_ids == refs[i], f"prompt {i} diverged"
        assert r.finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    assert any(results[(f"r{i}", 0)].num_cached_tokens > 0 for i in range(len(ps)))
    assert engine.pool.num_used == 0  # every block returned
    if compile:  # both graphs compiled at start (two warm-up forwards); every step ran one
        assert engine.runner.compiled_shape_classes == {True, False}
        assert engine.runner.compiled_steps == 2 + forwards


def test_compiled_engines_of_one_model_class_keep_their_own_graphs() -> None:
    """Each runner compiles its own entry with no guards on the model's modules: two llama
    engines in one process, with different weights and vocabularies, must each run graphs
    of their own model (a shared graph would give the other model's tokens or fail)."""
    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=3, vocab_size=TINY_VOCAB + 40)]
    ps = prompts(2)[:4]
    refs = [[reference_greedy(m, p, MAX_NEW) for p in ps] for m in models]  # before the engines
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engines = [
        LLMEngine(m, None, engine_settings(m, cpu_kernels="on", compile=True), f"tiny{i}")
        for i, m in enumerate(models)
    ]
    aots = [e.runner.aot for e in engines]
    assert aots[0] is not None and aots[1] is not None
    assert aots[0].key != aots[1].key  # different vocabularies: graphs of their own
    for round_ in range(2):  # the first engine again after the second compiled and ran
        for i, engine in enumerate(engines):
            subs = [Submission(f"m{i}-{round_}-{j}", p, greedy) for j, p in enumerate(ps)]
            results = run_engine(engine, subs)
            for j in range(len(ps)):
                assert results[(f"m{i}-{round_}-{j}", 0)].token_ids == refs[i][j], (i, round_, j)
    assert refs[0] != refs[1]  # the two models answer differently


def test_greedy_is_independent_of_batch_composition() -> None:
    model = tiny_model("llama", seed=1)
    ps = prompts(1)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = []
    for settings_kw, order in [
        (dict(prefill_chunk_tokens=64, max_num_batched_tokens=512), range(len(ps))),
        (
            dict(prefill_chunk_tokens=3, max_num_batched_tokens=7, enable_prefix_caching=False),
            reversed(range(len(ps))),
        ),
    ]:
        engine = LLMEngine(model, None, engine_settings(model, **settings_kw), "tiny")  # type: ignore[arg-type]
        subs = [Submission(f"r{i}", ps[i], greedy, arrive_at_step=k) for k, i in enumerate(order)]
        res = run_engine(engine, subs)
        outs.append([res[(f"r{i}", 0)].token_ids for i in range(len(ps))])
    assert outs[0] == outs[1]


def seeded(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_NEW,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=seed,
        n=n,
        ignore_eos=True,
        presence_penalty=0.3,
    )


def test_seeded_sampling_and_n_choices_reproducible_across_batches() -> None:
    model = tiny_model("qwen2", seed=2)
    ps = prompts(2)
    target = ps[5]  # 61 tokens
    alone = run_engine(
        LLMEngine(model, None, engine_settings(model), "tiny"),
        [Submission("t", target, seeded(1234, n=3))],
    )
    crowd_subs = [Submission(f"o{i}", p, seeded(i)) for i, p in enumerate(ps)]
    crowd_subs.insert(4, Submission("t", target, seeded(1234, n=3), arrive_at_step=3))
    engine = LLMEngine(
        model, None, engine_settings(model, num_blocks=40, prefill_chunk_tokens=5), "tiny"
    )
    max_shared = 0
    crowd: dict = {}
    pending = sorted(crowd_subs, key=lambda s: s.arrive_at_step)
    step = 0
    while pending or engine.has_unfinished():  # run_engine, watching block sharing
        while pending and pending[0].arrive_at_step <= step:
            s = pending.pop(0)
            engine.add_request(s.request_id, s.prompt, s.sampling)
        for out in engine.step():
            crowd.setdefault((out.request_id, out.chunk.index), []).extend(out.chunk.token_ids)
        max_shared = max(max_shared, max(engine.pool.ref_count))
        step += 1
    choices = [alone[("t", i)].token_ids for i in range(3)]
    assert [crowd[("t", i)] for i in range(3)] == choices
    assert len({tuple(c) for c in choices}) == 3  # the choices differ from each other
    assert max_shared >= 3  # the prompt's blocks were shared by the three choices
    assert engine.scheduler.num_preemptions > 0


def test_n_greedy_choices_equal_generate_and_share_the_prompt() -> None:
    model = tiny_model("llama", seed=3)
    p = prompts(3)[3]
    ref = reference_greedy(model, p, MAX_NEW)
    engine = LLMEngine(model, None, engine_settings(model), "tiny")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=3, ignore_eos=True)
    res = run_engine(engine, [Submission("g", p, params)])
    assert [res[("g", i)].token_ids for i in range(3)] == [ref] * 3
    assert all(res[("g", i)].finish_reason == "length" for i in range(3))


def test_stop_token_ids_max_tokens_and_abort() -> None:
    model = tiny_model("llama", seed=4)
    p = prompts(4)[2]
    ref = reference_greedy(model, p, MAX_NEW)
    engine = LLMEngine(model, None, engine_settings(model), "tiny")
    stop_at = ref[4]
    first = ref.index(stop_at)
    res = run_engine(
        engine,
        [
            Submission(
                "s",
                p,
                SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop_at]),
            ),
            Submission("m", p, SamplingParams(max_tokens=3, temperature=0.0)),
        ],
    )
    assert res[("s", 0)].token_ids == ref[: first + 1] and res[("s", 0)].finish_reason == "stop"
    assert res[("m", 0)].token_ids == ref[:3] and res[("m", 0)].finish_reason == "length"
    engine.add_request("a", p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    engine.step()
    assert engine.abort_request("a") and not engine.has_unfinished()
    assert engine.pool.num_used == 0


def test_logprobs_match_the_models_distribution() -> None:
    model = tiny_model("llama", seed=5)
    p = prompts(5)[1]
    engine = LLMEngine(model, None, engine_settings(model), "tiny")
    res = run_engine(
        engine, [Submission("l", p, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))]
    )
    r = res[("l", 0)]
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        full = model(torch.tensor([p + r.token_ids])).logits[0].float()
    ref = torch.log_softmax(full[len(p) - 1 : -1], -1)
    for k, entry in enumerate(r.logprobs):
        assert entry.token_id == r.token_ids[k] == entry.top[0].token_id
        assert entry.logprob == pytest.approx(float(ref[k, entry.token_id]), abs=1e-4)
        assert len(entry.top) == 2


def test_prompt_too_long_for_context_or_cache_is_refused() -> None:
    from libs.backend import BackendError

    model = tiny_model("llama")
    engine = LLMEngine(model, None, engine_settings(model, num_blocks=8, max_model_len=64), "tiny")
    with pytest.raises(BackendError) as e:
        engine.add_request("x", [1] * 60, SamplingParams(max_tokens=10))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(BackendError):
        engine.add_request("y", [1] * 30, SamplingParams(max_tokens=10))  # > 8 blocks of 4


def test_greedy_matches_generate_under_an_inter_token_target() -> None:
    """engine.itl_target_ms splits prompts into the few tokens a step has room for (here a
    fitted cost that leaves 3 prompt tokens a step beside the decode rows): same answers."""
    from libs.engine.step_cost import STEP_COST_MIN_STEPS, StepCostModel

    model = tiny_model("llama", seed=2)
    ps = prompts(2)
    refs = [reference_greedy(model, p, MAX_NEW) for p in ps]
    settings = engine_settings(model, itl_target_ms=20.0, min_prefill_tokens=2)
    engine = LLMEngine(model, None, settings, "tiny")  # type: ignore[arg-type]
    cost = StepCostModel()
    for i in range(STEP_COST_MIN_STEPS):  # 10 ms + 1 ms a decode row, 1 ms a prompt token
        cost.observe(1 + i % 8, 0, 0.010 + 0.001 * (1 + i % 8))
    for p in (8, 16, 32, 64):
        cost.observe(1, p, 0.011 + 0.001 * p)
    engine.scheduler.cost = engine.step_cost = cost
    engine.step_cost.observe = lambda *a: None  # type: ignore[method-assign]  # keep the fit
    steps: list[tuple[int, int]] = []  # (prompt tokens carried, allowance) of each step
    schedule = engine.scheduler.schedule

    def recorded():  # type: ignore[no-untyped-def]
        out = schedule()
        assert out.budget is not None
        steps.append((out.num_prefill_tokens, out.budget.tokens))
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=i) for i, p in enumerate(ps)]
    res = run_engine(engine, subs)
    for i in range(len(ps)):
        assert res[(f"r{i}", 0)].token_ids == refs[i], i
    assert all(carried <= allowed for carried, allowed in steps), steps
    assert min(allowed for _, allowed in steps) < settings.prefill_chunk_tokens  # it did bite
