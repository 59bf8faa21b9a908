"""Migration on the real model: two aggregated SmolLM2 workers as processes; the one streaming a
request is killed with SIGKILL mid-stream, the router moves the request to the other, and the
answer is the one an uninterrupted run gives — greedy equal to ``model.generate``, seeded
sampling equal to the same request run without a kill."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from libs.client import StraitClient
from tests.e2e.conftest import REAL_FLEET
from tests.support.procs import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


QUESTION = "Describe a river in autumn, in a few sentences."
MAX_TOKENS = 48
KILL_AFTER_DELTAS = 8
PREFIX = "mig.v1"


def generate_reference(model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return str(tok.decode(gen[0, len(ids) :], skip_special_tokens=True))


def wait_worker_ready(fleet: ProcessFleet, name: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while "worker ready" not in (fleet.tmp / f"{name}.log").read_text(errors="replace"):
        assert fleet.procs[name].poll() is None, fleet.logs(name)
        assert time.monotonic() < deadline, fleet.logs(name)
        time.sleep(0.2)


async def ask(
    client: StraitClient, fleet: ProcessFleet | None, **sampling: float | int
) -> tuple[str, int, int, float]:
    """One chat request over NATS; with ``fleet``, SIGKILL the worker that streams it after
    KILL_AFTER_DELTAS deltas. Returns text, completion tokens, migrations, and the seconds from
    the kill to the next delta."""
    text, deltas, killed_at, gap = "", 0, 0.0, 0.0
    async with client.generate(
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        want_route=True,
        idle_timeout_s=30,
        **sampling,  # type: ignore[arg-type]
    ) as gen:
        async for d in gen:
            text += d.text
            deltas += 1
            if killed_at and not gap:
                gap = time.monotonic() - killed_at
            if fleet is not None and deltas == KILL_AFTER_DELTAS:
                assert gen.route is not None
                name = f"worker{gen.route.worker_id.removeprefix('w')}"
                os.kill(fleet.procs[name].pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert gen.usage is not None
    return text, gen.usage.completion_tokens, gen.migrations, gap


def test_a_worker_killed_mid_stream_the_answer_does_not_change(
    tmp_path: Path, nats_url: str, smollm2: Path
) -> None:
    expected = generate_reference(smollm2)
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": PREFIX,
        "STRAIT_MODELS__DIR": str(smollm2.parent.resolve()),
    }
    with ProcessFleet(
        tmp_path, nats_url, REAL_FLEET, env=env, workers=[{}, {}], ready_timeout_s=180
    ) as fleet:
        for name in ("worker0", "worker1"):
            wait_worker_ready(fleet, name)
        time.sleep(1.0)  # a few beats: the router knows both

        async def scenario() -> None:
            async with StraitClient(nats_url, prefix=PREFIX, report_usage=False) as client:
                seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
                ref_seeded = await ask(client, None, **seeded)
                greedy = await ask(client, fleet, temperature=0.0)
                assert greedy[2] == 1, "the request did not migrate"
                assert greedy[0] == expected
                assert greedy[3] < 10.0
                # The killed worker comes back under a new id, so the next kill has a target.
                dead = next(n for n, p in fleet.procs.items() if p.poll() is not None)
                fleet.start(dead, "decode", {"STRAIT_WORKER__WORKER_ID": f"w{dead[-1]}"})
                await asyncio.to_thread(wait_worker_ready, fleet, dead)
                await asyncio.sleep(1.0)
                moved = await ask(client, fleet, **seeded)
                assert moved[2] == 1, "the request did not migrate"
                assert (moved[0], moved[1]) == (ref_seeded[0], ref_seeded[1])

        asyncio.run(scenario())
