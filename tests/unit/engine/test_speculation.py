"""Speculative decoding never changes the answer (libs/engine/spec, docs/speculation.md).

A scripted proposer (a test stand-in behind the ``Proposer`` interface) proposes the known
continuation with deliberate mistakes, so every step mixes kept and rejected proposals; the
output must equal the run without speculation — greedy (and ``model.generate``) under chunked
prefill, staggered arrivals, prefix hits and preemption; seeded sampling with penalties,
logprobs and ``n`` — and an unseeded sampler's distribution must be the model's. The real
proposers (``ngram``, ``suffix``) are tested on their own and end to end."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import msgspec
import pytest
import torch

from bench.support.tiny_models import TINY_VOCAB, tiny_model, tiny_tokenizer
from libs.engine.engine import LLMEngine
from libs.engine.sequence import Sequence
from libs.engine.spec import NgramProposer, Speculator, SuffixProposer
from libs.engine.spec.ngram import NgramIndex
from libs.engine.spec.prediction import PredictionIndex
from libs.engine.spec.suffix import SuffixCache
from libs.protocol import SamplingParams, StructuredOutput
from libs.settings import SpeculativeSettings
from tests.unit.engine.helpers import (
    Result,
    Submission,
    engine_settings,
    kv_bytes,
    reference_greedy,
    run_engine,
)

pytestmark = pytest.mark.unit

MAX_NEW = 24
SPEC = SpeculativeSettings(method="ngram", num_speculative_tokens=4, disable_by_batch_size=64)


class ScriptedProposer:
    """Proposes ``answers[request][output so far:]`` with one token in ``wrong_every`` (by
    position) replaced: kept runs, rejections and full acceptances all happen."""

    name = "scripted"

    def __init__(self, answers: dict[tuple[str, int], list[int]], wrong_every: int = 5) -> None:
        self.answers = answers
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        answer = self.answers.get((seq.request_id, seq.index))
        if answer is None:
            return []
        self.calls += 1
        start = seq.num_output_tokens
        out = list(answer[start : start + k])
        for i in range(len(out)):
            if (start + i + self.calls) % self.wrong_every == 0:
                out[i] = (out[i] + 1) % TINY_VOCAB
        return out

    def finished(self, seq: Sequence) -> None:
        pass


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    return [
        (system if i % 2 == 0 else []) + [rng.randrange(TINY_VOCAB) for _ in range(n)]
        for i, n in enumerate([3, 9, 17, 30, 5, 12, 1, 8])
    ]


def scripted_engine(model: torch.nn.Module, answers: dict, **kw: object) -> LLMEngine:
    engine = LLMEngine(model, None, engine_settings(model, speculative=SPEC, **kw), "tiny")  # type: ignore[arg-type]
    assert engine.speculator is not None
    engine.speculator.proposer = ScriptedProposer(answers)
    return engine


def outputs(results: dict[tuple[str, int], Result]) -> dict[tuple[str, int], list[int]]:
    return {k: r.token_ids for k, r in results.items()}


@pytest.mark.parametrize(
    ("arch", "cpu_kernels"), [("llama", "off"), ("llama", "on"), ("qwen2", "on")]
)
def test_greedy_with_proposals_equals_generate_under_chunks_prefix_hits_and_preemption(
    arch: str, cpu_kernels: str
) -> None:
    model = tiny_model(arch)
    ps = prompts()
    refs = [reference_greedy(model, p, MAX_NEW) for p in ps]
    # 26 blocks of 4 tokens: less than 8 sequences need at once, so some are preempted.
    engine = scripted_engine(
        model,
        {(f"r{i}", 0): ref for i, ref in enumerate(refs)},
        num_blocks=26,
        prefill_chunk_tokens=8,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        cpu_kernels=cpu_kernels,
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=2 * i) for i, p in enumerate(ps)]
    results = run_engine(engine, subs)
    for i in range(len(ps)):
        assert results[(f"r{i}", 0)].token_ids == refs[i], f"prompt {i} diverged"
        assert results[(f"r{i}", 0)].finish_reason == "length"
    spec = engine.speculator
    assert spec is not None
    assert 0 < spec.num_accepted < spec.num_proposed  # kept and rejected proposals both
    assert engine.scheduler.num_preemptions > 0
    assert any(results[(f"r{i}", 0)].num_cached_tokens > 0 for i in range(len(ps)))
    assert engine.pool.num_used == 0  # every block, those grown for proposals too, returned
    # Fewer forwards than tokens: the point of it.
    assert engine.num_steps < sum(len(r) for r in refs)


def seeded(seed: int, n: int = 1, **kw: object) -> SamplingParams:
    params: dict = dict(
        max_tokens=MAX_NEW,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=seed,
        n=n,
        ignore_eos=True,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        logprobs=3,
    )
    params.update(kw)
    return SamplingParams(**params)


def test_seeded_sampling_penalties_logprobs_and_n_are_unchanged() -> None:
    model = tiny_model("qwen2", seed=2)
    ps = prompts(2)
    subs = [Submission(f"s{i}", p, seeded(100 + i, n=1 + i % 3)) for i, p in enumerate(ps)]
    plain = run_engine(LLMEngine(model, None, engine_settings(model), "tiny"), subs)
    # Propose the plain run's own outputs (with mistakes): the seeded draws must line up.
    engine = scripted_engine(model, outputs(plain), num_blocks=60, prefill_chunk_tokens=5)
    spec = run_engine(engine, subs)
    assert outputs(spec) == outputs(plain)
    for key, r in plain.items():
        got = spec[key].logprobs
        assert [e.token_id for e in got] == [e.token_id for e in r.logprobs]
        assert [[t.token_id for t in e.top] for e in got] == [
            [t.token_id for t in e.top] for e in r.logprobs
        ]
        assert all(
            math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            for a, b in zip(got, r.logprobs, strict=True)
        )
    assert engine.speculator is not None and engine.speculator.num_accepted > 0


def test_stop_strings_eos_and_max_tokens_end_where_they_would() -> None:
    """The scripted proposer runs straight past a stop string and past max_tokens: the output
    still ends exactly where it ends without proposals (text and finish reason)."""
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=5, vocab_size=len(tok))
    prompt = tok.encode("hello world, hello strait; stop here. STOP now!")
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = run_engine(
        LLMEngine(model, tok, engine_settings(model), "tiny"), [Submission("b", prompt, free)]
    )
    text = base[("b", 0)].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cases = {
        "stop": SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
        "eos": SamplingParams(
            max_tokens=40, temperature=0.0, stop_token_ids=[base[("b", 0)].token_ids[9]]
        ),
        "len": SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    }
    subs = [Submission(name, prompt, p) for name, p in cases.items()]
    plain = run_engine(LLMEngine(model, tok, engine_settings(model), "tiny"), subs)
    answers = {(name, 0): base[("b", 0)].token_ids for name in cases}
    engine = LLMEngine(model, tok, engine_settings(model, speculative=SPEC), "tiny")
    assert engine.speculator is not None
    engine.speculator.proposer = ScriptedProposer(answers, wrong_every=1000)
    spec = run_engine(engine, subs)
    for name in cases:
        a, b = spec[(name, 0)], plain[(name, 0)]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), (
            name
        )
    assert (
        plain[("stop", 0)].finish_reason == "stop" and plain[("len", 0)].finish_reason == "length"
    )
    assert engine.pool.num_used == 0


def test_grammar_constrained_requests_keep_their_grammar() -> None:
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=6, vocab_size=len(tok))
    prompt = tok.encode("the river runs")
    plain_engine = LLMEngine(model, tok, engine_settings(model), "tiny")
    assert plain_engine.grammars is not None
    grammar = plain_engine.grammars.compile(
        StructuredOutput(regex="(hello |world |strait )+stop"), None
    )
    params = SamplingParams(max_tokens=30, temperature=0.0)
    plain = run_engine(plain_engine, [Submission("g", prompt, params, grammar=grammar)])
    engine = LLMEngine(model, tok, engine_settings(model, speculative=SPEC), "tiny")
    assert engine.speculator is not None
    engine.speculator.proposer = ScriptedProposer(outputs(plain), wrong_every=3)
    spec = run_engine(engine, [Submission("g", prompt, params, grammar=grammar)])
    assert spec[("g", 0)].text == plain[("g", 0)].text
    assert spec[("g", 0)].token_ids == plain[("g", 0)].token_ids


def chi_square_critical(df: int, alpha: float) -> float:
    """Upper ``alpha`` critical value of chi-square(df), Wilson-Hilferty approximation (within
    ~1% for df >= 3), with the normal quantile from the inverse error function by bisection."""
    lo, hi = 0.0, 10.0
    for _ in range(100):  # z with P(N > z) = alpha
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha:
            lo = mid
        else:
            hi = mid
    z = (lo + hi) / 2
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def test_unseeded_sampling_distribution_is_the_models() -> None:
    """4,000 unseeded requests of 3 tokens (temperature 1, top-k 4), the second token always
    proposed (half the time the likeliest token, half a fixed unlikely one): the joint
    distribution of the first two tokens must be the model's, by a chi-square goodness-of-fit
    test at significance 0.001 (a verifier that kept a proposal it should reject, or skewed
    the draw after a rejection, moves the proposed token's share by several points)."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=7)
    prompt = [5, 17, 99, 3, 42]
    top_k = 4
    with torch.inference_mode():

        def probs(tokens: list[int]) -> torch.Tensor:
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = logits.topk(top_k)
            p = torch.zeros_like(logits)
            p[top.indices] = torch.softmax(top.values, -1)
            return p

        p1 = probs(prompt)
        firsts = [int(t) for t in p1.nonzero().flatten()]
        expected = {}
        for a in firsts:
            p2 = probs([*prompt, a])
            for b in [int(t) for t in p2.nonzero().flatten()]:
                expected[(a, b)] = float(p1[a] * p2[b])
    likeliest = {
        a: max((b for (x, b) in expected if x == a), key=lambda b: expected[(a, b)]) for a in firsts
    }
    unlikely = min(expected, key=expected.__getitem__)[1]

    class Fixed:
        name = "fixed"

        def propose(self, seq: Sequence, k: int) -> list[int]:
            first = seq.token_ids[seq.num_prompt_tokens]
            return [likeliest[first] if seq.arrival % 2 else unlikely]

        def finished(self, seq: Sequence) -> None:
            pass

    n = 4000
    settings = engine_settings(model, num_blocks=600, max_num_seqs=64, max_num_batched_tokens=512)
    # Every request proposes (not adaptive: the test is about what verification keeps).
    always = SPEC.model_copy(update={"adaptive": False})
    engine = LLMEngine(
        model, None, settings.model_copy(update={"speculative": always}), "tiny", seed=1
    )
    assert engine.speculator is not None
    engine.speculator.proposer = Fixed()
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)
    counts: Counter[tuple[int, int]] = Counter()
    for batch in range(n // 64 + 1):
        subs = [Submission(f"u{batch}-{i}", prompt, params) for i in range(min(64, n - 64 * batch))]
        for r in run_engine(engine, subs).values():
            counts[(r.token_ids[0], r.token_ids[1])] += 1
    assert sum(counts.values()) == n
    assert set(counts) <= set(expected)
    assert engine.speculator.num_proposed >= n and 0 < engine.speculator.num_accepted < n
    # Cells expected fewer than 5 times are pooled into one.
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[cell], pooled_exp + e
            continue
        stat += (counts[cell] - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert stat < chi_square_critical(cells - 1, 0.001), (stat, cells)


# ---------------------------------------------------------------------------------- proposers


def test_ngram_index_finds_the_latest_earlier_copy_longest_first() -> None:
    idx = NgramIndex(2, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # Tail (2, 3) last ended at 6 (followed by 7); tail (5, 2, 3) never appeared before.
    assert idx.find(tokens, 3) == [7, 5, 2]
    tokens += [7]
    assert idx.find(tokens, 2) == [5, 2]  # (2, 3, 7) ended at 7, followed by 5
    assert NgramIndex(2, 3).find([4, 4], 2) == []  # the tail itself is never a match
    assert NgramIndex(2, 3).find([4, 4, 4], 2) == [4]  # (4, 4) ending at 1, followed by 4


def test_suffix_cache_is_bounded_and_forgets_dropped_outputs() -> None:
    cache = SuffixCache(2, 3, max_tokens=10)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.find([9, 2, 3], 2) == [4, 5]
    cache.add([7, 8, 9, 10, 11])  # 11 tokens kept > 10: the first output goes
    assert cache.num_tokens == 5
    assert cache.find([2, 3], 2) == []
    assert cache.find([8, 9], 3) == [10, 11]
    cache.add(list(range(100, 130)))  # longer than the bound: its last 10 tokens are kept
    assert cache.num_tokens == 10 and cache.find([120, 121], 1) == [122]


def test_suffix_proposer_uses_other_requests_outputs() -> None:
    s = SpeculativeSettings(method="suffix", prompt_lookup_min=2, prompt_lookup_max=3)
    p = SuffixProposer(s)

    def seq(tokens: list[int], prompt: int) -> Sequence:
        return Sequence("r", 0, tokens, prompt, SamplingParams(max_tokens=50))

    done = seq([1, 2, 50, 51, 52, 53, 54], 2)
    done.finish_reason = "length"
    p.finished(done)
    assert p.propose(seq([7, 8, 51, 52], 2), 3) == [53, 54]
    assert NgramProposer(s).propose(seq([7, 8, 51, 52], 2), 3) == []  # own tokens only
    aborted = seq([1, 2, 60, 61, 62], 2)
    aborted.finish_reason = "abort"
    p.finished(aborted)  # an aborted output is not kept
    assert p.propose(seq([9, 60, 61], 1), 2) == []


def make_seq(out: int = 0, **kw: object) -> Sequence:
    return Sequence("r", 0, list(range(10 + out)), 10, SamplingParams(max_tokens=20, **kw))  # type: ignore[arg-type]


def ngram_speculator(s: SpeculativeSettings, max_model_len: int) -> Speculator:
    return Speculator(s, "m", max_model_len, NgramProposer(s))


def test_depth_follows_acceptance_ceilings_and_room() -> None:
    sp = ngram_speculator(
        SpeculativeSettings(method="ngram", num_speculative_tokens=4, adaptive_probe_steps=3), 64
    )
    seq = make_seq(out=1)
    assert sp.depth(seq) == 4
    sp.record(seq, 4, 0)  # rate 0.5
    assert sp.depth(seq) == 2
    sp.record(seq, 2, 0)
    sp.record(seq, 1, 0)  # rate 0.125: depth 0, then a one-token probe every 3 steps
    assert [sp.depth(seq) for _ in range(3)] == [0, 0, 1]
    sp.record(seq, 1, 1)
    assert sp.depth(seq) == 2
    assert sp.depth(make_seq(out=1, num_speculative_tokens=1)) == 1  # the request's ceiling
    assert sp.depth(make_seq(out=1, num_speculative_tokens=0)) == 0
    assert sp.depth(make_seq(out=18)) == 1  # max_tokens 20: one proposal and the sampled token
    assert sp.depth(make_seq(out=19)) == 0
    assert ngram_speculator(SpeculativeSettings(method="ngram"), 31).depth(make_seq(out=19)) == 0


def test_no_proposals_when_many_sequences_decode() -> None:
    sp = ngram_speculator(SpeculativeSettings(method="ngram", disable_by_batch_size=2), 256)
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    seqs = [Sequence(f"r{i}", 0, [*loop, 3], 8, SamplingParams(max_tokens=50)) for i in range(3)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1  # decoding
    sp.propose(seqs[:2])
    assert seqs[0].spec_tokens == [1, 2, 3]  # what followed the latest copy of (3, 1, 2, 3)
    sp.propose(seqs)
    assert all(s.spec_tokens == [] for s in seqs)


def test_ngram_proposer_end_to_end_is_exact_and_backs_off() -> None:
    """The real prompt-lookup proposer, n-grams of one token, a prompt holding every token:
    it proposes at every step (a random model rarely agrees); the output is still exact, and
    the adaptive depth falls so that most steps propose little or nothing."""
    model = tiny_model("llama", seed=8)
    prompt = list(range(TINY_VOCAB))
    ref = reference_greedy(model, prompt, 40)
    s = SpeculativeSettings(
        method="ngram", prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=8
    )
    engine = LLMEngine(model, None, engine_settings(model, speculative=s), "tiny")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert run_engine(engine, [Submission("n", prompt, greedy)])[("n", 0)].token_ids == ref
    sp = engine.speculator
    assert sp is not None and sp.num_proposed > 0
    assert sp.num_proposed < 4 * 39 / 2  # adaptive: far from 4 proposals on every step


# ------------------------------------------------------------------------ predicted outputs


def test_prediction_index_walks_the_prediction_in_order() -> None:
    doc = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7]
    idx = PredictionIndex(doc, 2, 3)
    assert idx.find([5, 1, 2, 3], 2) == [9, 1]  # the first copy: the answer starts there
    assert idx.find([5, 1, 2, 3, 9, 1, 2, 3], 2) == [8, 1]  # past the cursor: the next copy
    assert idx.find([2, 3], 3) == [7]  # the last copy when none is past the cursor
    assert idx.find([4, 4], 2) == [] and idx.find([3, 7], 2) == []  # unknown; nothing follows


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_a_predicted_output_speeds_up_without_changing_the_answer(method: str) -> None:
    """OpenAI's ``prediction``: the known answer with edits (a changed token, a dropped run, an
    inserted run) as the prediction; greedy and seeded outputs equal the runs without it, and
    most of the prediction is kept — with speculation off in the pool too."""
    model = tiny_model("llama", seed=4)
    ps = prompts(4)[:4]
    refs = [reference_greedy(model, p, 40) for p in ps]  # before an engine patches the model
    spec = SpeculativeSettings(method=method, num_speculative_tokens=6, disable_by_batch_size=64)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"g{i}", p, greedy) for i, p in enumerate(ps)]
    subs += [Submission(f"s{i}", p, seeded(300 + i, n=1 + i % 2)) for i, p in enumerate(ps)]
    off = SpeculativeSettings(method="off")
    plain = run_engine(LLMEngine(model, None, engine_settings(model, speculative=off), "t"), subs)

    def edited(tokens: list[int]) -> list[int]:
        out = list(tokens)
        out[5] = (out[5] + 1) % TINY_VOCAB
        del out[12:15]
        return [*out[:20], 7, 7, 7, *out[20:]]

    predicted = [
        dataclasses.replace(s, prediction=edited(plain[(s.request_id, 0)].token_ids)) for s in subs
    ]
    engine = LLMEngine(model, None, engine_settings(model, speculative=spec), "t")
    got = run_engine(engine, predicted)
    assert outputs(got) == outputs(plain)
    assert [got[(f"g{i}", 0)].token_ids for i in range(len(ps))] == refs
    sp = engine.speculator
    assert sp.num_accepted > 0.5 * sum(len(r.token_ids) for r in plain.values()) / 2
    if method == "off":  # a pool without speculation speculates for predictions only
        no_prediction = LLMEngine(model, None, engine_settings(model, speculative=spec), "t")
        run_engine(no_prediction, subs)
        assert no_prediction.speculator.num_proposed == 0


# ---------------------------------------------------------------------------------- draft


def draft_model(kind: str) -> torch.nn.Module:
    """The tiny target's own weights (it proposes what the target samples greedily), or a
    one-layer random model with the same vocabulary (it rarely does)."""
    if kind == "same":
        return tiny_model("llama")
    from transformers import AutoModelForCausalLM

    from bench.support.tiny_models import tiny_config

    torch.manual_seed(9)
    config = tiny_config("llama")
    config.num_hidden_layers = 1
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["same", "other"])
def test_draft_model_greedy_and_seeded_equal_no_speculation(kind: str) -> None:
    model = tiny_model("llama")
    ps = prompts(4)
    refs = [reference_greedy(model, p, MAX_NEW) for p in ps]
    s = SpeculativeSettings(
        method="draft",
        draft_model="tiny-draft",
        disable_by_batch_size=64,
        draft_kv_cache_bytes=kv_bytes(model, 64, 4),  # 64 blocks of 4 tokens: fewer than all need
    )
    settings = engine_settings(model, num_blocks=40, speculative=s)
    engine = LLMEngine(model, None, settings, "tiny", draft_model=draft_model(kind))
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"g{i}", p, greedy, arrive_at_step=i) for i, p in enumerate(ps)]
    subs += [Submission(f"s{i}", p, seeded(7 + i)) for i, p in enumerate(ps[:3])]
    plain = run_engine(LLMEngine(model, None, engine_settings(model), "tiny"), subs)
    got = run_engine(engine, subs)
    assert outputs(got) == outputs(plain)
    assert [got[(f"g{i}", 0)].token_ids for i in range(len(ps))] == refs
    sp = engine.speculator
    assert sp is not None and sp.num_proposed > 0
    if kind == "same":  # every greedy proposal is kept
        assert sp.num_accepted > 0.5 * sp.num_proposed
    assert engine.pool.num_used == 0
    assert sp.proposer.inner.pool.num_used == 0  # type: ignore[attr-defined]  # the draft's blocks too


def test_draft_model_must_share_the_vocabulary() -> None:
    model = tiny_model("llama")
    other = tiny_model("llama", vocab_size=TINY_VOCAB + 8)
    s = SpeculativeSettings(method="draft", draft_model="x")
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(model, None, engine_settings(model, speculative=s), "tiny", draft_model=other)


def test_step_cost_fit_and_break_even_gate() -> None:
    from libs.engine.step_cost import STEP_COST_MIN_STEPS, StepCost

    cost = StepCost()
    assert cost.break_even(8) == 0.0  # no fit yet: nothing is held back
    for i in range(STEP_COST_MIN_STEPS):
        rows = 1 + i % 5
        cost.add(rows, 0.0066 + 0.0017 * rows)  # a = 6.6 ms, b = 1.7 ms a row
    fit = cost.fit()
    assert fit is not None
    assert math.isclose(fit[0], 0.0066, rel_tol=1e-6) and math.isclose(fit[1], 0.0017, rel_tol=1e-6)
    assert math.isclose(cost.break_even(1), 0.0017 / 0.0083, rel_tol=1e-6)
    assert cost.break_even(32) > 0.85  # a large batch needs nearly every proposal kept
    assert cost.break_even(0) == 0.0  # nothing decoding (prompts only): no division by zero
    steep = StepCost()
    for i in range(STEP_COST_MIN_STEPS):
        steep.add(1 + i % 2, 0.001 * (1 + i % 2))  # a = 0: all cost is per row
    assert steep.break_even(1) == 1.0 and steep.break_even(0) == 0.0
    sp = ngram_speculator(SpeculativeSettings(method="ngram", adaptive_probe_steps=100), 64)
    seq = make_seq(out=1)
    seq.spec_rate = 0.6
    assert sp.depth(seq, break_even=0.5) == 2 and sp.depth(seq, break_even=0.7) == 0


def test_a_new_sequence_starts_from_the_workers_recent_acceptance() -> None:
    sp = ngram_speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=4), 64)
    assert sp.depth(make_seq(out=1)) == 4  # nothing measured yet: optimistic
    old = make_seq(out=1)
    for _ in range(60):  # the worker's proposals mostly fail
        sp.record(old, 4, 0)
    assert sp.rate < 0.1
    fresh = make_seq(out=1)
    assert sp.depth(fresh, break_even=0.5) == 0  # a newcomer does not pay to find out again


def test_a_failing_proposer_never_fails_a_request() -> None:
    model = tiny_model("llama")
    p = prompts()[1]
    ref = reference_greedy(model, p, MAX_NEW)

    class Broken:
        name = "broken"

        def propose(self, seq: Sequence, k: int) -> list[int]:
            raise RuntimeError("proposer bug")

        def finished(self, seq: Sequence) -> None:
            pass

    engine = LLMEngine(model, None, engine_settings(model, speculative=SPEC), "tiny")
    assert engine.speculator is not None
    engine.speculator.proposer = Broken()
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    assert run_engine(engine, [Submission("b", p, greedy)])[("b", 0)].token_ids == ref


@pytest.mark.parametrize("migrated", [False, True])
def test_handoff_and_migration_with_proposals_equal_one_engine(migrated: bool) -> None:
    """A decode engine that speculates after a KV handoff (the first token given), or after a
    migration (earlier output replayed), gives the uninterrupted run's tokens, greedy and
    seeded; the prefill side's exported blocks hold verified tokens only."""
    from libs.backend import Resume
    from libs.engine import kv_transfer

    model = tiny_model("llama", seed=3)
    prompt = list(range(5, 35))
    for sampling in (
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
        seeded(11),
    ):
        whole = run_engine(
            LLMEngine(model, None, engine_settings(model), "tiny"),
            [Submission("r", prompt, sampling)],
        )[("r", 0)]
        prefill = LLMEngine(model, None, engine_settings(model, speculative=SPEC), "tiny")
        kept = 6 if migrated else 1
        head = msgspec.structs.replace(sampling, max_tokens=kept)
        before = run_engine(prefill, [Submission("r", prompt, head)])[("r", 0)]
        assert before.token_ids == whole.token_ids[:kept]
        kv = prefill.export_prefix(prompt + before.token_ids[:-1])
        assert kv is not None
        decode = scripted_engine(model, {("r", 0): whole.token_ids})
        decode.import_prefix(kv_transfer.decode(kv_transfer.encode(kv)))
        resume = (
            Resume(replayed=before.token_ids)
            if migrated
            else Resume(before.token_ids[0], before.logprobs[0] if before.logprobs else None)
        )
        decode.add_request("r", prompt, sampling, resume=resume)
        after = run_engine(decode, [])[("r", 0)]
        expected = whole.token_ids[kept:] if migrated else whole.token_ids
        assert after.token_ids == expected
        assert decode.speculator is not None and decode.speculator.num_accepted > 0


def test_a_verification_estimates_the_chance_of_keeping_each_proposed_token() -> None:
    sp = ngram_speculator(SpeculativeSettings(method="ngram", adaptive_weight=1.0), 64)
    seq = make_seq(out=1)
    sp.record(seq, 4, 2)  # kept, kept, rejected: 2 of 3 tried
    assert seq.spec_rate is not None and math.isclose(seq.spec_rate, 2 / 3)
    sp.record(seq, 4, 4)  # all kept: no rejection seen
    assert seq.spec_rate == 1.0
    sp.record(seq, 3, 0)
    assert seq.spec_rate == 0.0


def test_allocation_runs_proposals_while_they_lift_the_batchs_tokens_per_second() -> None:
    sp = ngram_speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=16), 256)
    a, b = 0.005, 0.00125  # a step of 5 ms plus 1.25 ms a row

    def seqs(rates: list[float]) -> list[Sequence]:
        out = []
        for r in rates:
            s = make_seq(out=1)
            s.spec_rate = r
            out.append(s)
        return out

    # One stream keeping 90%: proposal j is worth 0.9 ** j tokens for 1.25 ms; the 8th
    # (0.43 tokens) no longer beats the 5.7 tokens / 15 ms the first seven reach.
    assert sp.allocate(seqs([0.9]), [[1] * 16], a, b) == [7]
    assert sp.allocate(seqs([0.9]), [[1] * 3], a, b) == [3]  # no more than were offered
    assert sp.allocate(seqs([0.45]), [[1] * 16], a, b) == [1]
    # 32 streams at 77%: the batch already yields 32 tokens / 45 ms; a 0.77-token row does not.
    assert sp.allocate(seqs([0.77] * 32), [[1] * 16] * 32, a, b) == [0] * 32
    # Two streams: the predictable one gets the rows, the other (nothing offered) none.
    assert sp.allocate(seqs([0.95, 0.95]), [[1] * 16, []], a, b)[1] == 0
    # A free row (b = 0 is never fitted as such; tiny b) runs everything offered.
    assert sp.allocate(seqs([0.6]), [[1] * 5], a, 1e-9) == [5]


def test_once_the_step_cost_is_fitted_proposals_are_cut_to_the_allocation() -> None:
    from libs.engine.step_cost import STEP_COST_MIN_STEPS

    sp = ngram_speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=8), 256)
    for i in range(STEP_COST_MIN_STEPS):
        rows = 1 + i % 8
        sp.observe_step(rows, 0.005 + 0.00125 * rows)
    seq = Sequence(
        "r", 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3], 12, SamplingParams(max_tokens=64)
    )
    seq.num_computed_tokens = seq.num_tokens - 1  # decoding
    seq.spec_rate = 0.45
    sp.propose([seq])
    assert seq.spec_tokens == [4]  # the prompt offers 4..12; at 45% one is worth its row
    seq.spec_rate = 0.95
    sp.propose([seq])
    assert seq.spec_tokens == [4, 5, 6, 7, 8, 9, 10, 11]  # all eight offered
