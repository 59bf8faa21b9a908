"""Flow control on the real model: a quiet team's request beside another team's flood of twice
the worker's seats is seated at once (a headroom seat), answers the greedy reference, and ends
before any of the flood's requests, which all end too."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import pytest
import torch

from bench.support.procs import ProcessFleet
from libs.protocol import (
    ChatMessage,
    ErrorMessage,
    Finished,
    GenerateRequest,
    SamplingParams,
    Subjects,
    TokenDelta,
    decode_stream,
)
from libs.settings import NatsSettings
from tests.e2e.conftest import REAL_FLEET

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFIX = "fair.v1"
SEATS = 16  # REAL_FLEET's engine.max_num_seqs
QUIET = "Name three rivers."


def reference(model_dir: Path, question: str, n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return str(tok.decode(gen[0, len(ids) :], skip_special_tokens=True))


async def ask(nc: nats.NATS, rid: str, team: str, question: str, n: int) -> tuple[str, float]:
    """One request on the fleet's subject, billed as ``team``: (its text, when it ended)."""
    subjects = Subjects.of(NatsSettings(subject_prefix=PREFIX))
    sub = await nc.subscribe(subjects.stream(rid))
    req = GenerateRequest(
        request_id=rid,
        messages=[ChatMessage("user", question)],
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=team == "flood"),
        team=team,
    )
    await nc.jetstream().publish(subjects.requests, msgspec.json.encode(req))
    text = ""
    while True:
        msg = decode_stream((await sub.next_msg(timeout=300)).data)
        if isinstance(msg, TokenDelta):
            text += msg.text
        if isinstance(msg, ErrorMessage):
            raise AssertionError(f"{rid}: {msg.code} {msg.message}")
        if isinstance(msg, Finished):
            await sub.unsubscribe()
            return text, time.monotonic()


def test_a_quiet_team_is_seated_beside_a_flood(
    tmp_path: Path, nats_url: str, smollm2: Path
) -> None:
    expected = reference(smollm2, QUIET, 8)
    env = {"STRAIT_NATS__SUBJECT_PREFIX": PREFIX, "STRAIT_MODELS__DIR": str(smollm2.parent)}
    with ProcessFleet(tmp_path, nats_url, REAL_FLEET, env=env, ready_timeout_s=180):

        async def run() -> tuple[tuple[str, float], list[tuple[str, float]]]:
            nc = await nats.connect(nats_url)
            try:
                floods = [
                    asyncio.create_task(ask(nc, f"flood-{i}", "flood", "Tell a story.", 96))
                    for i in range(2 * SEATS)
                ]
                await asyncio.sleep(1.0)  # the flood holds every seat and a queue as long
                quiet = await ask(nc, "quiet-0", "quiet", QUIET, 8)
                return quiet, await asyncio.gather(*floods)
            finally:
                await nc.close()

        (text, quiet_end), floods = asyncio.run(run())
    assert text == expected  # a headroom seat changes no answer
    assert len(floods) == 2 * SEATS  # every flood request ended with Finished
    assert quiet_end < min(end for _, end in floods)  # it waited behind none of them
