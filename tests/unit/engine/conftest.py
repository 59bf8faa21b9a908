"""Engine test fixtures. Tiny models run on one thread: on this 2-core machine, shared with
other test runs, torch's thread pool makes small matmuls 10-20× slower."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
