"""The real fleet on the real default model: HTTP in, SSE out, tokens equal to transformers'.

Router, one aggregated worker on SmolLM2-135M-Instruct and the gateway run as separate
processes on a real nats-server; the official ``openai`` SDK is the client.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.support.procs import ProcessFleet
from tests.e2e.conftest import REAL_FLEET

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


QUESTIONS = ["Name three rivers.", "What is 2 + 2?", "Say hello in French.", "Why is the sky blue?"]
MAX_TOKENS = 20


def reference_texts(model_dir: Path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tok.decode(gen[0, len(ids) :], skip_special_tokens=True))
    return out


@pytest.mark.parametrize(
    ("mode", "weights"),
    [("aggregated", "none"), ("disaggregated", "none"), ("disaggregated", "gguf")],
)
def test_concurrent_streams_equal_generate(
    tmp_path: Path, nats_url: str, smollm2: Path, mode: str, weights: str
) -> None:
    """Four concurrent chats, twice (the second round hits the prefix cache), equal
    ``model.generate``'s greedy text — in one aggregated worker, and split over a prefill and a
    decode worker process with the KV blocks handed off over NATS; and served from the GGUF's
    own 4-bit blocks (float32 activations into the block kernel: the float model's bits). The
    second round predicts each answer (OpenAI's ``prediction``): the same text comes back."""
    from openai import AsyncOpenAI

    from libs.engine import kernels

    if weights == "gguf":
        k = kernels.load("auto", "cpu", "float32")
        if k is None or not k.avx2:
            pytest.skip("the GGUF's blocks give the float model's bits on AVX2 CPUs")
    expected = reference_texts(smollm2)
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": "real.v1",
        "STRAIT_MODELS__DIR": str(smollm2.parent.resolve()),
        "STRAIT_ENGINE__QUANTIZATION": weights,
        "STRAIT_ENGINE__QUANT_ACTIVATIONS": "float32",
    }
    config = REAL_FLEET + f'mode = "{mode}"\n'  # the last table is the pool
    workers: list[dict[str, str]] = [{}]
    extra: list[tuple[str, str, dict[str, str]]] = []
    if mode == "disaggregated":
        workers = [{"STRAIT_WORKER__ROLE": "decode"}]
        extra = [("prefill", "prefill", {"STRAIT_WORKER__WORKER_ID": "p0"})]
    with ProcessFleet(
        tmp_path,
        nats_url,
        config,
        env=env,
        workers=workers,
        extra_services=extra,
        ready_timeout_s=180,
    ) as fleet:
        client = AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)

        async def ask(q: str, predicted: str | None) -> tuple[str, int]:
            extra: dict[str, Any] = {}
            if predicted is not None:
                extra["prediction"] = {"type": "content", "content": predicted}
            stream = await client.chat.completions.create(
                model="auto",
                messages=[{"role": "user", "content": q}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **extra,
            )
            text, completion_tokens = "", 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
            return text, completion_tokens

        async def all_at_once() -> list[list[tuple[str, int]]]:
            try:
                return [
                    await asyncio.gather(
                        *(ask(q, p) for q, p in zip(QUESTIONS, hints, strict=True))
                    )
                    for hints in ([None] * len(QUESTIONS), expected)
                ]
            finally:
                await client.close()

        rounds = asyncio.run(all_at_once())
        if mode == "disaggregated":  # the decode process served what the prefill one handed off
            assert "handoff admitted" in fleet.logs("worker0")
        if weights == "gguf":  # both processes served the GGUF's blocks (start-up lines)
            for name in ("worker0", "prefill"):
                assert "gguf-q4_1" in (fleet.tmp / f"{name}.log").read_text(errors="replace")
    for results in rounds:
        assert [t for t, _ in results] == expected
        assert all(0 < n <= MAX_TOKENS for _, n in results)
