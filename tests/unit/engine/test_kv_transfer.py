"""Disaggregated handoff on a tiny model: blocks prefilled by one engine, moved as bytes, reused
by another, and the answer does not change."""

from __future__ import annotations

import pytest

from libs.engine import kv_transfer
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import (
    Submission,
    engine_settings,
    reference_greedy,
    run_engine,
    tiny_model,
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
