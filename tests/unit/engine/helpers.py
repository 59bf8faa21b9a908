"""Builders shared by the engine tests: an engine driver and the transformers reference
(``model.generate``). The tiny random-weight models and tokenizer are in
``bench.support.tiny_models`` (benches build them too)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from libs.engine.attention import KvCache
from libs.engine.engine import LLMEngine
from libs.protocol import LogprobEntry, Priority, SamplingParams
from libs.settings import EngineSettings


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decode of one prompt (no padding, no batching); stops after
    EOS like the engine does without ``ignore_eos`` (tiny test models have no EOS)."""
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt], device=next(model.parameters()).device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def kv_bytes(model: torch.nn.Module, num_blocks: int, block_size: int) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per = KvCache.bytes_per_block(
        c.num_hidden_layers, block_size, c.num_key_value_heads, head_dim, torch.float32
    )
    return per * num_blocks


def engine_settings(
    model: torch.nn.Module, *, num_blocks: int = 256, block_size: int = 4, **kw: Any
) -> EngineSettings:
    defaults: dict[str, Any] = dict(
        block_size=block_size,
        kv_cache_bytes=kv_bytes(model, num_blocks, block_size),
        max_num_batched_tokens=32,
        prefill_chunk_tokens=8,
        max_num_seqs=8,
        max_model_len=512,
        # A compile happens before the engine serves (a test asserts on compiled steps).
        compile_background=False,
    )
    defaults.update(kw)
    return EngineSettings(**defaults)


@dataclass
class Result:
    """Everything one choice produced."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class Submission:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: Priority = "interactive"
    arrive_at_step: int = 0
    grammar: str | None = None  # from LLMEngine.grammars.compile
    prediction: list[int] = field(default_factory=list)  # a predicted output's tokens


def run_engine(
    engine: LLMEngine, submissions: Iterable[Submission]
) -> dict[tuple[str, int], Result]:
    """Drive ``engine`` until idle, adding each submission at its step; (request, choice) → Result."""
    pending = sorted(submissions, key=lambda s: s.arrive_at_step)
    results: dict[tuple[str, int], Result] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrive_at_step <= step:
            s = pending.pop(0)
            engine.add_request(
                s.request_id,
                s.prompt,
                s.sampling,
                s.priority,
                grammar=s.grammar,
                prediction=s.prediction,
            )
        for out in engine.step():
            r = results.setdefault((out.request_id, out.chunk.index), Result())
            r.token_ids += out.chunk.token_ids
            r.text += out.chunk.text
            r.logprobs += out.chunk.logprobs or []
            r.num_cached_tokens = out.chunk.num_cached_tokens
            if out.chunk.finish_reason:
                r.finish_reason = out.chunk.finish_reason
        step += 1
        assert step < 10_000, "engine did not finish"
    return results
