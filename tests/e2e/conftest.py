"""End-to-end fixtures: the real default model, prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.settings import Settings

# A real-model fleet on a small KV budget, speculating (prompt lookup, as `make run` does: every
# real-fleet test then checks that it changes no answer); append the pool's own keys
# (mode = ...) at the end, since the last table is the pool.
REAL_FLEET = """
[gateway]
auth_enabled = false
[router]
metrics_port = 0
[engine]
kv_cache_bytes = 134217728
max_num_seqs = 16
[engine.speculative]
method = "ngram"
[[pools]]
name = "default"
model = "smollm2-135m-instruct"
backend = "engine"
"""


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from libs.models import prepare_model

    return prepare_model("smollm2-135m-instruct", Settings(), progress=False)
