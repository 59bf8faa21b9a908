"""Builders shared by the engine tests: tiny random-weight models, a tiny byte-level tokenizer,
an engine driver, and the transformers reference (``model.generate``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.engine.attention import KvCache
from libs.engine.engine import LLMEngine
from libs.protocol import LogprobEntry, Priority, SamplingParams
from libs.settings import EngineSettings

TINY_VOCAB = 320
# Large init so logits are peaked: near-ties (where float reordering could flip an arg-max)
# become vanishingly rare in random-weight models.
TINY_INIT_RANGE = 0.5


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=TINY_INIT_RANGE,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=None)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size), dtype=torch.float32)
    return model.eval()


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


def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained here on a few sentences (multi-byte UTF-8 characters
    span several tokens), wrapped as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|end|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "the river runs under bridges of light while quiet engines hum",
        "tokens flow through narrow straits toward open water 水 東京 🙂",
        "hello world, hello strait; stop here. STOP now!",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = (
        "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def save_tiny_model_dir(path: Path, arch: str = "llama") -> Path:
    """A loadable model directory (weights + config + tokenizer) for backend tests."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, vocab_size=len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
