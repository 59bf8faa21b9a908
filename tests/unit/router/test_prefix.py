"""The router hashes prompts exactly as the workers do."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.backend.fake import FakeBackend
from libs.protocol import ChatMessage, GenerateRequest, SamplingParams
from libs.settings import FakeEngineSettings, PoolSettings, Settings
from services.router.prefix import (
    NullPrefixHasher,
    PrefixHashers,
    TokenizerPrefixHasher,
    WordPrefixHasher,
    chain_hashes,
)

pytestmark = pytest.mark.unit

SMOLLM_DIR = Path(".strait/models/smollm2-135m-instruct")


def req(**kw: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {"prompt": "the quick  brown\nfox " * 20},
        {"messages": [ChatMessage("system", "be brief"), ChatMessage("user", "a b c " * 30)]},
        {"prompt_token_ids": list(range(70))},
    ],
)
def test_word_hasher_matches_the_fake_backend(kw: dict[str, object]) -> None:
    fake = FakeBackend(FakeEngineSettings(), model_name="fm", block_size=16)
    prepared = fake.prepare(
        prompt=kw.get("prompt"),  # type: ignore[arg-type]
        prompt_token_ids=kw.get("prompt_token_ids"),  # type: ignore[arg-type]
        messages=kw.get("messages"),  # type: ignore[arg-type]
        sampling=SamplingParams(),
    )
    ids = WordPrefixHasher().token_ids(req(**kw))
    assert ids == prepared.token_ids
    assert chain_hashes(ids, 16, "fm") == fake.block_hashes(prepared.token_ids)


def test_chain_hash_matches_the_engine() -> None:
    hashing = pytest.importorskip("libs.engine.hashing")
    ids = list(range(1000, 1100))
    assert chain_hashes(ids, 16, "m") == hashing.chain_hashes(ids, 16, "m")


def test_unknown_models_fall_back_to_no_overlap(tmp_path: Path) -> None:
    s = Settings()
    s.models.dir = str(tmp_path)
    s.pools = [PoolSettings(name="p", model="nowhere")]
    h = PrefixHashers(s).hasher("p", "nowhere")
    assert isinstance(h, NullPrefixHasher) and h.token_ids(req(prompt="x")) is None


@pytest.mark.skipif(not SMOLLM_DIR.exists(), reason="smollm2 not prepared")
def test_tokenizer_hasher_caches_per_message_and_stays_exact() -> None:
    h = TokenizerPrefixHasher(SMOLLM_DIR)
    assert h.per_piece
    msgs = [ChatMessage("system", "You are terse."), ChatMessage("user", "Hello, there!  ")]
    text = h.render(msgs)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = h.token_ids(req(messages=msgs))
    assert ids == list(h.tokenizer.encode(text, add_special_tokens=False).ids)
    assert "system\nYou are terse." in h._cache.data  # the system turn is tokenized once


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM_DIR.exists(), reason="smollm2 not prepared")
def test_tokenizer_hasher_matches_transformers_chat_template() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOLLM_DIR))
    h = TokenizerPrefixHasher(SMOLLM_DIR)
    msgs = [ChatMessage("user", "Write a haiku about\n\n rivers."), ChatMessage("assistant", "ok")]
    want = tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in msgs],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    assert h.token_ids(req(messages=msgs)) == want
    assert h.token_ids(req(prompt="Once upon a time")) == tok("Once upon a time")["input_ids"]


def _raw_prompts(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    words = ["the", "river", "\n", "  ", "\n\n", "x", "é", "12", ":", "\t", "def", "STOP", "水"]
    return [
        "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randrange(1, 40)))
        for _ in range(n)
    ]


def _tiny_tokenizer_dir(tmp_path: Path) -> Path:
    from bench.support.tiny_models import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_raw_prompts_line_by_line_equal_the_whole_prompt(which: str, tmp_path: Path) -> None:
    """Raw prompts are tokenized (and cached) line by line when that is exact; a shared
    document then costs one cache lookup per line."""
    if which == "smollm2" and not SMOLLM_DIR.exists():
        pytest.skip("smollm2 not prepared")
    h = TokenizerPrefixHasher(SMOLLM_DIR if which == "smollm2" else _tiny_tokenizer_dir(tmp_path))
    assert h.per_line
    for text in _raw_prompts(500):
        assert h.token_ids(req(prompt=text)) == h._encode_prompt(text), repr(text)
    doc = "A shared document line.\nAnother line of it.\n"
    h.token_ids(req(prompt=doc + "First question?"))
    assert "A shared document line.\n" in h._cache.data
    assert "Another line of it.\n" in h._cache.data
