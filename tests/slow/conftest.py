"""Slow tests on the real default model (SmolLM2-135M-Instruct, converted once via libs.models)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from libs.models import prepare_model

    return prepare_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Other test runs share this 2-core machine; one thread keeps timings sane.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
