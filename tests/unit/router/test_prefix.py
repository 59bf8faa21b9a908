"""The router hashes prompts exactly as the workers do."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.fake_engine import FakeBackend
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
