"""Tiny random-weight models and a tiny byte-level tokenizer, built in seconds on a CPU: the
engine tests' models, ``bench.gpu_step --tiny``'s config and the model of ``bench.chaos``'s
disaggregated scenarios.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
