"""Model preparation: the known default model converts once and is reused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from libs.models import ModelNotFoundError, cli_list, is_converted, list_models, prepare_model
from libs.settings import Settings

pytestmark = pytest.mark.slow


def test_prepare_is_idempotent_and_listed(smollm2_dir: Path) -> None:
    assert is_converted(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").exists() and (
        smollm2_dir / "tokenizer.json"
    ).exists()
    t0 = time.monotonic()
    assert prepare_model("smollm2-135m-instruct", progress=False) == smollm2_dir
    assert time.monotonic() - t0 < 1.0  # reused, not converted again
    assert prepare_model(str(smollm2_dir)) == smollm2_dir  # a directory is used as is
    rows = {r["name"]: r for r in list_models()}
    assert rows["smollm2-135m-instruct"]["prepared"] is True
    assert any(line.startswith("smollm2-135m-instruct\tprepared") for line in cli_list())


def test_unknown_model_says_what_to_do(tmp_path: Path) -> None:
    settings = Settings(state_dir=str(tmp_path))
    settings.models.dir = str(tmp_path / "models")
    with pytest.raises(ModelNotFoundError, match="not a local directory"):
        prepare_model("no-such-model-xyz", settings)
