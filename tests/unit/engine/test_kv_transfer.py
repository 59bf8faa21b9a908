"""Disaggregated handoff on a tiny model: blocks prefilled by one engine, moved as bytes, reused
by another, and the answer does not change."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from bench.support.tiny_models import tiny_model, tiny_tokenizer
from libs.backend import BackendError
from libs.engine import kv_transfer
from libs.engine.engine import LLMEngine, Resume
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import (
    Result,
    Submission,
    engine_settings,
    reference_greedy,
    run_engine,
)

pytestmark = pytest.mark.unit


def test_exported_blocks_give_prefix_hits_elsewhere_with_the_same_tokens() -> None:
    model = tiny_model("llama", seed=7)
    prompt = list(range(3, 40))  # 37 tokens: 9 full blocks of 4
    ref = reference_greedy(model, prompt, 8)
    prefill = LLMEngine(model, None, engine_settings(model), "tiny")
    one = SamplingParams(max_tokens=1, temperature=0.0)
    run_engine(prefill, [Submission("p", prompt, one)])
    exported = prefill.export_prefix(prompt)
    assert exported is not None and len(exported.header.block_hashes) == 9

    payload = kv_transfer.encode(exported)
    pieces = kv_transfer.split(payload, 4096)
    assert len(pieces) > 1
    received = kv_transfer.decode(b"".join(pieces))
    assert received.header == exported.header

    decode = LLMEngine(model, None, engine_settings(model), "tiny")
    assert decode.import_prefix(received) == 9
    assert decode.import_prefix(received) == 0  # idempotent
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    res = run_engine(decode, [Submission("d", prompt, greedy)])
    assert res[("d", 0)].num_cached_tokens == 36
    assert res[("d", 0)].token_ids == ref


def test_malformed_payloads_are_rejected() -> None:
    with pytest.raises(ValueError):
        kv_transfer.decode(b"\x00")
    with pytest.raises(ValueError):
        kv_transfer.decode(b"\x00\x00\x00\x02{}")
    model = tiny_model("llama")
    engine = LLMEngine(model, None, engine_settings(model), "tiny")
    run_engine(engine, [Submission("p", list(range(9)), SamplingParams(max_tokens=1))])
    kv = engine.export_prefix(list(range(9)))
    assert kv is not None
    truncated = kv_transfer.encode(kv)[:-1]
    with pytest.raises(ValueError):
        kv_transfer.decode(truncated)
    kv.header.model_id = "other"
    with pytest.raises(ValueError):
        engine.import_prefix(kv)


def _handoff(
    model: torch.nn.Module, prompt: list[int], sampling: SamplingParams, tokenizer: Any = None
) -> Result:
    """Prefill on one engine (first token only), move the blocks as bytes, resume on another."""
    prefill = LLMEngine(model, tokenizer, engine_settings(model), "tiny")
    first = msgspec.structs.replace(sampling, max_tokens=1)
    head = run_engine(prefill, [Submission("r", prompt, first)])[("r", 0)]
    kv = prefill.export_prefix(prompt)
    assert kv is not None
    decode = LLMEngine(model, tokenizer, engine_settings(model), "tiny")
    decode.import_prefix(kv_transfer.decode(kv_transfer.encode(kv)))
    lp = head.logprobs[0] if head.logprobs else None
    decode.add_request("r", prompt, sampling, resume=Resume(head.token_ids[0], lp))
    return run_engine(decode, [])[("r", 0)]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=0.8,
            seed=5,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            logprobs=3,
            ignore_eos=True,
        ),
    ],
    ids=["greedy", "seeded", "penalties-logprobs"],
)
def test_resume_after_handoff_equals_one_engine(sampling: SamplingParams) -> None:
    model = tiny_model("llama", seed=3)
    prompt = list(range(5, 35))  # 30 tokens: 7 full blocks of 4 handed off, 2 + 1 recomputed
    whole = run_engine(
        LLMEngine(model, None, engine_settings(model), "tiny"), [Submission("r", prompt, sampling)]
    )[("r", 0)]
    resumed = _handoff(model, prompt, sampling)
    assert resumed.token_ids == whole.token_ids
    assert resumed.finish_reason == whole.finish_reason == "length"
    assert resumed.num_cached_tokens == 28
    if sampling.logprobs:
        assert [e.token_id for e in resumed.logprobs] == [e.token_id for e in whole.logprobs]
        assert [e.logprob for e in resumed.logprobs] == pytest.approx(
            [e.logprob for e in whole.logprobs], abs=1e-4
        )


def test_resume_text_and_stop_strings_match_one_engine() -> None:
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=2, vocab_size=len(tok))
    prompt = tok("the river runs under bridges of light")["input_ids"]
    for stop in ([], ["e"]):
        sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop)
        whole = run_engine(
            LLMEngine(model, tok, engine_settings(model), "tiny"),
            [Submission("r", prompt, sampling)],
        )[("r", 0)]
        resumed = _handoff(model, prompt, sampling, tok)
        assert (resumed.text, resumed.token_ids, resumed.finish_reason) == (
            whole.text,
            whole.token_ids,
            whole.finish_reason,
        )


def test_a_resumed_request_has_one_choice() -> None:
    model = tiny_model("llama")
    engine = LLMEngine(model, None, engine_settings(model), "tiny")
    with pytest.raises(BackendError):
        engine.add_request("r", [1, 2, 3], SamplingParams(n=2), resume=Resume(4))
