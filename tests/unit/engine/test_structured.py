"""Structured outputs and logit_bias in the batched sampler, on a tiny random model with a tiny
byte-level tokenizer: every constrained output parses and validates whatever the batching,
chunking, preemption, forks and seeds; unconstrained rows beside constrained ones keep their
tokens; an invalid constraint is refused before it is queued."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from bench.support.tiny_models import tiny_model, tiny_tokenizer
from libs.backend import BackendError, Resume
from libs.engine.engine import LLMEngine
from libs.engine.tools import ToolSpec, parse_tool_calls
from libs.protocol import SamplingParams, StructuredOutput, ToolFunction
from tests.unit.engine.helpers import Submission, engine_settings, run_engine

pytestmark = pytest.mark.unit

# A finite language: every constrained answer ends by the grammar's end, never by length.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)[0-9]{2}@(x|y)\.com"
CHOICES = ["river", "bridge", "strait"]
WEATHER = ToolFunction(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "city": {"enum": ["Lima", "Oslo"]}},
        "required": ["unit", "city"],
        "additionalProperties": False,
    },
)
TIME = ToolFunction(
    name="get_time",
    parameters={
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "local"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return tiny_tokenizer()


def make_engine(tok, **kw):  # type: ignore[no-untyped-def]
    model = tiny_model("llama", vocab_size=len(tok))
    settings = engine_settings(model, **kw)
    return LLMEngine(model, tok, settings, "tiny")


def prompts(tok, n: int, seed: int = 0) -> list[list[int]]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    words = "the river runs under bridges of light while quiet engines hum".split()
    return [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(2, 12))))
        for _ in range(n)
    ]


def test_mixed_constrained_batch_with_preemption_forks_and_seeds(tok) -> None:  # type: ignore[no-untyped-def]
    # 48 blocks of 4 tokens for 12 requests (some n=2) → preemption; chunked prefill of 8.
    engine = make_engine(
        tok, num_blocks=48, prefill_chunk_tokens=8, max_num_batched_tokens=24, max_num_seqs=6
    )
    g = engine.grammars
    assert g is not None
    grammars = {
        "json": g.compile(StructuredOutput(json=SCHEMA), None),
        "regex": g.compile(StructuredOutput(regex=REGEX), None),
        "choice": g.compile(StructuredOutput(choice=CHOICES), None),
        "tools": g.compile(None, ToolSpec((WEATHER, TIME), "required", parallel=False)),
        "none": None,
    }
    kinds = list(grammars)
    subs = []
    system = tok.encode("quiet engines hum while the river runs under bridges of light. ")
    for i, p in enumerate(prompts(tok, 12)):
        p = system + p if i % 2 else p  # prefix-cache hits for the later ones
        kind = kinds[i % len(kinds)]
        sampled = i % 3 == 0
        sp = SamplingParams(
            max_tokens=100,
            temperature=0.9 if sampled else 0.0,
            seed=i if sampled else None,
            n=2 if i % 4 == 1 else 1,
            ignore_eos=kind == "none",
        )
        subs.append(Submission(f"{kind}-{i}", p, sp, arrive_at_step=i, grammar=grammars[kind]))
    results = run_engine(engine, subs)
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_cached_tokens > 0 for r in results.values())
    checked = 0
    for (rid, _), r in results.items():
        kind = rid.split("-")[0]
        if kind == "none":
            continue
        assert r.finish_reason == "stop", (rid, r.text)
        if kind == "json":
            jsonschema.validate(json.loads(r.text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, r.text), r.text
        elif kind == "choice":
            assert r.text in CHOICES
        else:
            content, calls = parse_tool_calls(r.text, [WEATHER, TIME])
            assert calls and content == "", r.text
            for c in calls:
                schema = WEATHER.parameters if c.name == "get_weather" else TIME.parameters
                jsonschema.validate(json.loads(c.arguments), schema)
        checked += 1
    assert checked == sum(s.sampling.n for s in subs if not s.request_id.startswith("none"))
    assert engine.pool.num_used == 0


def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(tok) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(tok, 6, seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = run_engine(
        make_engine(tok),
        [Submission(f"u{i}", p, greedy if i % 2 else seeded) for i, p in enumerate(ps)],
    )
    engine = make_engine(tok)
    grammar = engine.grammars.compile(StructuredOutput(json=SCHEMA), None)  # type: ignore[union-attr]
    subs = [Submission(f"u{i}", p, greedy if i % 2 else seeded) for i, p in enumerate(ps)]
    subs += [
        Submission(f"c{i}", p, greedy, arrive_at_step=i, grammar=grammar) for i, p in enumerate(ps)
    ]
    mixed = run_engine(engine, subs)
    for i in range(len(ps)):
        assert mixed[(f"u{i}", 0)].token_ids == alone[(f"u{i}", 0)].token_ids


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(tok) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    grammar = engine.grammars.compile(StructuredOutput(json=SCHEMA), None)  # type: ignore[union-attr]
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    r = run_engine(engine, [Submission("a", prompts(tok, 1)[0], sp, grammar=grammar)])
    assert r[("a", 0)].finish_reason == "length"
    assert len(r[("a", 0)].token_ids) == 3
    assert r[("a", 0)].text.startswith("{")


def test_a_resumed_first_token_advances_the_grammar(tok) -> None:  # type: ignore[no-untyped-def]
    """The decode side of a handoff: the first token came from the prefill worker under the same
    grammar; the rest of the answer continues that grammar."""
    prompt = prompts(tok, 1, seed=3)[0]
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    whole = make_engine(tok)
    grammar = whole.grammars.compile(StructuredOutput(choice=CHOICES), None)  # type: ignore[union-attr]
    ref = run_engine(whole, [Submission("a", prompt, sp, grammar=grammar)])[("a", 0)]
    decode = make_engine(tok)
    decode.add_request("a", prompt, sp, resume=Resume(ref.token_ids[0]), grammar=grammar)
    out: list[int] = []
    while decode.has_unfinished():
        for o in decode.step():
            out += o.chunk.token_ids
    assert out == ref.token_ids
    assert tok.decode(out) in CHOICES


def test_migrated_tokens_replay_through_the_grammar(tok) -> None:  # type: ignore[no-untyped-def]
    """A migration: the first tokens of a JSON answer were streamed by a lost worker; a fresh
    engine replays them through a new matcher and the rest keeps to the schema."""
    prompt = prompts(tok, 1, seed=4)[0]
    sp = SamplingParams(max_tokens=60, temperature=0.0)
    whole = make_engine(tok)
    grammar = whole.grammars.compile(StructuredOutput(json=SCHEMA), None)  # type: ignore[union-attr]
    ref = run_engine(whole, [Submission("a", prompt, sp, grammar=grammar)])[("a", 0)]
    assert len(ref.token_ids) > 4
    moved = make_engine(tok)
    moved.add_request("a", prompt, sp, resume=Resume(replayed=ref.token_ids[:4]), grammar=grammar)
    rest = run_engine(moved, [])[("a", 0)]
    assert ref.token_ids[:4] + rest.token_ids == ref.token_ids
    assert rest.finish_reason == ref.finish_reason


def test_logit_bias_forces_and_forbids_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    prompt = prompts(tok, 1, seed=4)[0]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = run_engine(engine, [Submission("a", prompt, plain)])[("a", 0)].token_ids
    forced = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={"77": 100.0}
    )
    assert run_engine(engine, [Submission("b", prompt, forced)])[("b", 0)].token_ids == [77] * 6
    banned = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={str(base[0]): -100.0}
    )
    out = run_engine(engine, [Submission("c", prompt, banned)])[("c", 0)].token_ids
    assert base[0] not in out[:1]
    # The bias is added to the logits: the reference is the model's own arg-max after adding.
    plain_model = tiny_model("llama", vocab_size=len(tok))  # the engine's weights, unpacked
    with torch.inference_mode():
        logits = plain_model(torch.tensor([prompt])).logits[0, -1].float()
        logits[base[0]] -= 100.0
    assert out[0] == int(logits.argmax())
    with pytest.raises(BackendError) as e:
        engine.add_request("d", prompt, SamplingParams(logit_bias={str(10**6): 1.0}))
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize(
    ("structured", "param"),
    [
        (StructuredOutput(regex="a("), "structured.regex"),
        (StructuredOutput(grammar="root ::= ("), "structured.grammar"),
        (StructuredOutput(json={"type": "nonsense"}), "structured.json"),
    ],
)
def test_an_invalid_constraint_is_refused_with_its_param(tok, structured, param) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    with pytest.raises(BackendError) as e:
        engine.grammars.compile(structured, None)  # type: ignore[union-attr]
    assert e.value.code == "invalid_request"
    assert e.value.param == param


def test_gbnf_and_lark_grammars_both_constrain(tok) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    g = engine.grammars
    assert g is not None
    subs = [
        Submission(
            name,
            prompts(tok, 1, seed=5)[0],
            SamplingParams(max_tokens=30, temperature=0.0),
            grammar=g.compile(StructuredOutput(grammar=text), None),
        )
        for name, text in [
            ("gbnf", 'root ::= "id-" [0-9] [0-9] ("x" | "y")'),
            ("lark", 'start: "id-" /[0-9]{2}/ ("x" | "y")'),
        ]
    ]
    results = run_engine(engine, subs)
    for name in ("gbnf", "lark"):
        assert re.fullmatch(r"id-[0-9]{2}[xy]", results[(name, 0)].text), name


def test_a_named_tool_is_the_only_call(tok) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    spec = ToolSpec((WEATHER, TIME), "auto", name="get_time")
    grammar = engine.grammars.compile(None, spec)  # type: ignore[union-attr]
    sp = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=3)
    results = run_engine(engine, [Submission("a", prompts(tok, 1)[0], sp, grammar=grammar)])
    for i in range(3):
        _, calls = parse_tool_calls(results[("a", i)].text, [WEATHER, TIME])
        assert [c.name for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0].arguments), TIME.parameters)


def test_parallel_calls_may_end_after_any_call(tok) -> None:  # type: ignore[no-untyped-def]
    """With parallel calls the grammar allows EOS after each complete call (here the bias makes
    EOS win as soon as it is allowed: one call, then the end)."""
    engine = make_engine(tok)
    grammar = engine.grammars.compile(None, ToolSpec((WEATHER, TIME), "required"))  # type: ignore[union-attr]
    eos = tok.eos_token_id
    sp = SamplingParams(max_tokens=200, temperature=0.0, logit_bias={str(eos): 100.0})
    r = run_engine(engine, [Submission("a", prompts(tok, 1)[0], sp, grammar=grammar)])[("a", 0)]
    assert r.finish_reason == "stop", r.text
    _, calls = parse_tool_calls(r.text, [WEATHER, TIME])
    assert len(calls) == 1


@pytest.mark.parametrize("vocab", [320, 333, 64 * 32 + 5])
def test_mask_kernel_equals_the_torch_unpacking(vocab: int) -> None:
    """The CPU kernel's masking equals the torch fallback's: rows picked out of a larger batch,
    vocabularies that are not a multiple of 32."""
    from libs.engine import kernels
    from libs.engine.structured import mask_rows

    k = kernels.load("auto", "cpu", "float32")
    if k is None:
        pytest.skip("no CPU kernels on this machine")

    class Fixed:
        """A stand-in matcher whose allowed tokens are fixed (llguidance fills by pointer)."""

    words = (vocab + 31) // 32
    g = torch.Generator().manual_seed(vocab)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bits[1] = -1  # a row where everything in range is allowed
    import llguidance.torch as llt

    def fill(m, bitmask, j):  # type: ignore[no-untyped-def]
        bitmask[j] = bits[m.row]

    logits = torch.randn(5, vocab, generator=g)
    matchers = []
    for row in range(3):
        m = Fixed()
        m.row = row  # type: ignore[attr-defined]
        matchers.append(m)
    real_fill = llt.fill_next_token_bitmask
    llt.fill_next_token_bitmask = fill  # type: ignore[assignment]
    try:
        by_kernel, by_torch = logits.clone(), logits.clone()
        mask_rows(by_kernel, [4, 0, 2], matchers, k.mask_rows)
        mask_rows(by_torch, [4, 0, 2], matchers, None)
    finally:
        llt.fill_next_token_bitmask = real_fill
    assert torch.equal(by_kernel, by_torch)
    assert torch.equal(by_kernel[[1, 3]], logits[[1, 3]])  # untouched rows
    assert bool(torch.isinf(by_kernel[4]).any()) and not bool(torch.isinf(by_kernel[1]).any())


def test_matchers_made_off_the_engine_thread_are_the_ones_used(tok) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tok)
    g = engine.grammars
    assert g is not None
    grammar = g.compile(StructuredOutput(choice=CHOICES), None)
    made = [g.matcher(grammar) for _ in range(2)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, n=2)
    engine.add_request("a", prompts(tok, 1)[0], sp, grammar=grammar, matchers=list(made))
    texts = ["", ""]
    seen: set[int] = set()
    while engine.has_unfinished():
        for req in engine.requests.values():
            seen.update(id(s.matcher) for s in req.seqs)
        for o in engine.step():
            texts[o.chunk.index] += o.chunk.text
    assert seen == {id(m) for m in made}
    assert all(t in CHOICES for t in texts)


def test_a_seeded_constrained_answer_does_not_depend_on_its_batch(tok) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(tok, 5, seed=9)
    sp = SamplingParams(max_tokens=60, temperature=1.0, seed=11)
    alone_engine = make_engine(tok)
    grammar = alone_engine.grammars.compile(StructuredOutput(json=SCHEMA), None)  # type: ignore[union-attr]
    alone = run_engine(alone_engine, [Submission("s", ps[0], sp, grammar=grammar)])[("s", 0)]
    batch_engine = make_engine(tok)
    others = [
        Submission(f"o{i}", p, SamplingParams(max_tokens=30, temperature=0.8), arrive_at_step=i)
        for i, p in enumerate(ps[1:])
    ]
    mixed = run_engine(
        batch_engine, [*others, Submission("s", ps[0], sp, arrive_at_step=2, grammar=grammar)]
    )[("s", 0)]
    assert mixed.token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), SCHEMA)


def test_a_schema_beside_forced_calls_allows_either(tok) -> None:  # type: ignore[no-untyped-def]
    """response_format and tool_choice "required" together: a call or JSON under the schema."""
    engine = make_engine(tok)
    g = engine.grammars
    assert g is not None
    grammar = g.compile(StructuredOutput(json=SCHEMA), ToolSpec((TIME,), "required"))
    assert grammar is not None
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    answer = '{"ok": true, "color": "red", "size": 2}'
    for text in (call, answer):
        m = g.matcher(grammar)
        assert m.consume_tokens(tok.encode(text)), (text, m.get_error())
        assert m.is_accepting()
    m = g.matcher(grammar)
    assert not m.consume_tokens(tok.encode('{"zone": "utc"}'))
