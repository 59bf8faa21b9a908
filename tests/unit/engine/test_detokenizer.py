"""The detokenizer against real tokenizers: SmolLM2's (byte-level BPE, from the converted model
directory, prepared once if missing) and a tiny trained one."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest

from bench.support.tiny_models import tiny_tokenizer
from libs.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit

TRICKY = [
    "Hello, world! How are you?",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇯🇵 mixed in",
    "中文文本：東京は日本の首都です。",
    "  leading spaces, double  spaces,\ttabs\nand newlines\n\n",
    "café naïve résumé — “quotes” ‘single’ …",
    "code: def f(x):\n    return x ** 2  # ∑",
]


@cache
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from libs.models import prepare_model

    return AutoTokenizer.from_pretrained(str(prepare_model("smollm2-135m-instruct")))


def stream(tokenizer: Any, ids: list[int], stop: list[str] | None = None) -> tuple[list[str], bool]:
    d = IncrementalDetokenizer(tokenizer, stop or [])
    deltas = [d.add_tokens([t]) for t in ids]
    deltas.append(d.finish())
    return deltas, d.stopped


@pytest.mark.parametrize("tok", ["smollm2", "tiny"])
def test_concatenated_deltas_equal_a_whole_decode(tok: str) -> None:
    tokenizer = smollm2_tokenizer() if tok == "smollm2" else tiny_tokenizer()
    rng = random.Random(0)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TRICKY]
    # Random id sequences include special tokens and byte pieces that never form valid UTF-8.
    vocab = len(tokenizer)
    cases += [[rng.randrange(vocab) for _ in range(40)] for _ in range(30)]
    for ids in cases:
        deltas, _ = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("tok", ["smollm2", "tiny"])
def test_never_emits_half_a_character(tok: str) -> None:
    tokenizer = smollm2_tokenizer() if tok == "smollm2" else tiny_tokenizer()
    for text in TRICKY:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas, _ = stream(tokenizer, ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text


def test_stop_string_across_token_boundaries_is_cut_and_not_emitted() -> None:
    tokenizer = smollm2_tokenizer()
    text = "The answer is 42.\n\nUser: next question"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, stopped = stream(tokenizer, ids, stop=["\n\nUser"])
    assert stopped and "".join(deltas) == "The answer is 42."
    # Text that merely starts like a stop string is held back, then released.
    deltas, stopped = stream(
        tokenizer, tokenizer.encode("a\n\nb", add_special_tokens=False), stop=["\n\nUser"]
    )
    assert not stopped and "".join(deltas) == "a\n\nb"
    # The earliest of several stop strings wins; a stop inside a multi-byte character works.
    deltas, stopped = stream(
        tokenizer, tokenizer.encode("東京は日本", add_special_tokens=False), stop=["日", "京は"]
    )
    assert stopped and "".join(deltas) == "東"
