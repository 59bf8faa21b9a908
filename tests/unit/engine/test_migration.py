"""Migration on a tiny model: a request whose first k output tokens were streamed by a worker
that died continues on a fresh engine (``Resume.replayed``), and the client's whole answer —
the lost worker's streamed text plus the continuation — equals one uninterrupted run."""

from __future__ import annotations

from typing import Any

import pytest

from bench.support.tiny_models import tiny_model, tiny_tokenizer
from libs.engine.detokenizer import IncrementalDetokenizer
from libs.engine.engine import LLMEngine, Resume
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import Result, Submission, engine_settings, run_engine

pytestmark = pytest.mark.unit


def _streamed_text(tok: Any, tokens: list[int], stop: list[str]) -> str:
    """The text a worker had streamed for ``tokens`` (one detokenizer step per token)."""
    d = IncrementalDetokenizer(tok, stop)
    return "".join(d.add_tokens([t]) for t in tokens)


def _migrated(
    model: Any, tok: Any, prompt: list[int], sampling: SamplingParams, replayed: list[int]
) -> Result:
    engine = LLMEngine(model, tok, engine_settings(model), "tiny")
    engine.add_request("r", prompt, sampling, resume=Resume(replayed=replayed))
    return run_engine(engine, []).get(("r", 0), Result())


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0.8,
            seed=5,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop=["ge"]),
    ],
    ids=["greedy", "seeded", "penalties", "stop-string"],
)
@pytest.mark.parametrize("k", [1, 6])
def test_a_migrated_request_continues_exactly(sampling: SamplingParams, k: int) -> None:
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=4, vocab_size=len(tok))
    prompt = tok("the river runs under bridges of light")["input_ids"]
    whole = run_engine(
        LLMEngine(model, tok, engine_settings(model), "tiny"), [Submission("r", prompt, sampling)]
    )[("r", 0)]
    k = min(k, len(whole.token_ids) - 1)
    replayed = whole.token_ids[:k]
    rest = _migrated(model, tok, prompt, sampling, replayed)
    assert replayed + rest.token_ids == whole.token_ids
    assert _streamed_text(tok, replayed, sampling.stop) + rest.text == whole.text
    assert rest.finish_reason == whole.finish_reason


def test_a_replay_that_reaches_max_tokens_reports_only_the_finish() -> None:
    model = tiny_model("llama", seed=4)
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    whole = run_engine(
        LLMEngine(model, None, engine_settings(model), "tiny"),
        [Submission("r", [3, 4, 5, 6], sampling)],
    )[("r", 0)]
    rest = _migrated(model, None, [3, 4, 5, 6], sampling, whole.token_ids)
    assert rest.token_ids == [] and rest.finish_reason == "length"
