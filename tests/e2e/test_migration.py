"""Migration on the real model: two SmolLM2 workers as processes (aggregated, or decode workers
behind one prefill worker); the one streaming a request is killed with SIGKILL mid-stream, the
router moves the request to the other, and the answer is the one an uninterrupted run gives —
greedy equal to ``model.generate``, seeded sampling equal to the same request without a kill."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch

from bench.support.procs import ProcessFleet
from libs.client import StraitClient
from libs.protocol import StreamOwner, Subjects
from tests.e2e.conftest import REAL_FLEET

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
    client: StraitClient, fleet: ProcessFleet | None, owners: dict[str, str], **sampling: float
) -> tuple[str, int, int]:
    """One chat request over NATS; with ``fleet``, SIGKILL the worker that streams it after
    KILL_AFTER_DELTAS deltas (the routed worker, or the decode worker that announced it owns
    the stream). Returns text, completion tokens and migrations."""
    text, deltas = "", 0
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
            if fleet is not None and deltas == KILL_AFTER_DELTAS:
                assert gen.route is not None
                worker_id = owners.get(gen.request_id, gen.route.worker_id)
                os.kill(fleet.procs[NAMES[worker_id]].pid, signal.SIGKILL)
    assert gen.usage is not None
    return text, gen.usage.completion_tokens, gen.migrations


# Worker id → ProcessFleet process name.
NAMES = {"w0": "worker0", "w1": "worker1"}


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_a_worker_killed_mid_stream_the_answer_does_not_change(
    tmp_path: Path, nats_url: str, smollm2: Path, mode: str
) -> None:
    """Greedy: equal to ``model.generate``. Seeded: equal to the same request uninterrupted.
    Disaggregated: the decode worker streaming it is killed, and the request goes through the
    prefill worker again to the other decode worker."""
    expected = generate_reference(smollm2)
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": PREFIX,
        "STRAIT_MODELS__DIR": str(smollm2.parent.resolve()),
    }
    role = {"STRAIT_WORKER__ROLE": "decode"} if mode == "disaggregated" else {}
    extra = [("prefill", "prefill", {"STRAIT_WORKER__WORKER_ID": "p0"})] if role else []
    config = REAL_FLEET + f'mode = "{mode}"\n'
    with ProcessFleet(
        tmp_path,
        nats_url,
        config,
        env=env,
        workers=[role, role],
        extra_services=extra,
        ready_timeout_s=180,
    ) as fleet:
        for name in ("worker0", "worker1", *(n for n, _, _ in extra)):
            wait_worker_ready(fleet, name)
        time.sleep(1.0)  # a few beats: the router knows them all

        async def scenario() -> None:
            import nats

            owners: dict[str, str] = {}
            spy = await nats.connect(nats_url)

            async def on_owner(msg: nats.aio.msg.Msg) -> None:
                o = msgspec.json.decode(msg.data, type=StreamOwner)
                owners[o.request_id] = o.worker_id

            await spy.subscribe(Subjects(PREFIX).stream_owner, cb=on_owner)
            async with StraitClient(nats_url, prefix=PREFIX, report_usage=False) as client:
                seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
                ref_seeded = await ask(client, None, owners, **seeded)
                greedy = await ask(client, fleet, owners, temperature=0.0)
                assert greedy[2] == 1, "the request did not migrate"
                assert greedy[0] == expected
                # The killed worker comes back (same id), so the next kill has a target.
                dead = next(n for n, p in fleet.procs.items() if p.poll() is not None)
                fleet.start(dead, "worker", {"STRAIT_WORKER__WORKER_ID": f"w{dead[-1]}", **role})
                await asyncio.to_thread(wait_worker_ready, fleet, dead)
                await asyncio.sleep(1.0)
                moved = await ask(client, fleet, owners, **seeded)
                assert moved[2] == 1, "the request did not migrate"
                assert (moved[0], moved[1]) == (ref_seeded[0], ref_seeded[1])
            await spy.drain()

        asyncio.run(scenario())
