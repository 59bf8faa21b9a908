"""The FAKE engine's cost model: a token's time grows with the requests the worker runs (as a
real engine's step does with its rows), a prompt costs per uncached token, and the calibrated
profile shipped in configs/ is the one bench/fake_calibration.py measures against."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest

import libs.backend.fake as fake_engine
from libs.backend.fake import FakeBackend
from libs.protocol import SamplingParams
from libs.settings import FakeEngineSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


async def _run(backend: FakeBackend, n: int, tokens: int, prompt_words: int) -> list[float]:
    """Start ``n`` requests at once and return every sleep the backend asked for."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def record(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> None:
        prompt = backend.prepare(
            prompt=" ".join(f"w{i}x{k}" for k in range(prompt_words)),
            prompt_token_ids=None,
            messages=None,
            sampling=sampling,
        )
        async for _ in backend.generate(f"r{i}", prompt, sampling, "interactive"):
            pass

    orig = fake_engine.asyncio.sleep
    fake_engine.asyncio.sleep = record  # type: ignore[assignment]
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        fake_engine.asyncio.sleep = orig  # type: ignore[assignment]
    return slept


async def test_token_time_grows_with_the_rows_running() -> None:
    s = FakeEngineSettings(per_token_s=0.01, per_row_s=0.002, per_prompt_token_s=0.001)
    alone = await _run(FakeBackend(s), 1, tokens=5, prompt_words=8)
    # One prefill of 8 uncached tokens, then 4 token gaps at one row's cost.
    assert alone[0] == pytest.approx(8 * 0.001)
    assert alone[1:] == pytest.approx([0.01] * 4)
    four = await _run(FakeBackend(s), 4, tokens=5, prompt_words=8)
    gaps = [x for x in four if x != pytest.approx(8 * 0.001)]
    # While all four run, each gap costs one row plus three others.
    assert max(gaps) == pytest.approx(0.01 + 3 * 0.002)


def test_default_has_no_batch_cost_and_calibrated_profile_loads() -> None:
    assert FakeBackend(FakeEngineSettings()).token_s() == FakeEngineSettings().per_token_s
    table = tomllib.loads((ROOT / "configs" / "fake-calibrated.toml").read_text())
    cal = FakeEngineSettings(**table["fake_engine"])
    # The measured engine's step grows with its rows, and a row's step is dearer than the
    # growth per extra row (a step's fixed part: weights read once for every row).
    assert cal.per_row_s > 0
    assert cal.per_token_s > cal.per_row_s
    assert cal.per_prompt_token_s > 0


async def test_answer_words_ends_an_answer_with_stop_before_max_tokens() -> None:
    """``answer_words`` makes a text answer end like a model's end of sequence ("stop");
    an answer cut by max_tokens first still reports "length"."""

    async def finish(s: FakeEngineSettings, max_tokens: int) -> tuple[int, str | None]:
        backend = FakeBackend(s)
        sampling = SamplingParams(max_tokens=max_tokens)
        prompt = backend.prepare(
            prompt="hello there", prompt_token_ids=None, messages=None, sampling=sampling
        )
        chunks = [c async for c in backend.generate("r", prompt, sampling, "interactive")]
        return len(chunks), chunks[-1].finish_reason

    quick = FakeEngineSettings(per_token_s=0.0, per_prompt_token_s=0.0, answer_words=3)
    assert await finish(quick, 10) == (3, "stop")
    assert await finish(quick, 2) == (2, "length")
    assert await finish(quick, 3) == (3, "length")
    assert await finish(FakeEngineSettings(per_token_s=0.0, per_prompt_token_s=0.0), 10) == (
        10,
        "length",
    )
