"""AsyncEngineBackend (the workers' Backend) on a tiny model directory saved in the test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.support.tiny_models import save_tiny_model_dir
from libs.backend import Backend, BackendError
from libs.engine.async_engine import AsyncEngineBackend
from libs.protocol import ChatMessage, SamplingParams
from libs.settings import EngineSettings

pytestmark = pytest.mark.unit


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncEngineBackend:
    path = save_tiny_model_dir(tmp_path / "tiny")
    settings = EngineSettings(
        block_size=4, kv_cache_bytes=4 * 2**20, max_model_len=256, num_threads=1
    )
    b = AsyncEngineBackend(settings, str(path), "tiny")
    await b.start()
    yield b  # type: ignore[misc]
    await b.stop()


async def collect(b: AsyncEngineBackend, rid: str, sampling: SamplingParams, **prompt: object):
    kw = dict(prompt=None, prompt_token_ids=None, messages=None)
    kw.update(prompt)
    prepared = b.prepare(sampling=sampling, **kw)  # type: ignore[arg-type]
    return [c async for c in b.generate(rid, prepared, sampling, "interactive")]


async def test_streams_choices_until_finished_and_satisfies_the_protocol(
    backend: AsyncEngineBackend,
) -> None:
    _: Backend = backend  # structural check against libs.backend.Backend
    sampling = SamplingParams(max_tokens=10, temperature=0.0, n=2, ignore_eos=True)
    chunks = await collect(backend, "a", sampling, messages=[ChatMessage("user", "hello world")])
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.token_ids) for c in mine) == 10
        assert mine[-1].finish_reason == "length" and all(
            c.finish_reason is None for c in mine[:-1]
        )
        text = "".join(c.text for c in mine)
        ids = [t for c in mine for t in c.token_ids]
        assert text == backend.tokenizer.decode(ids, skip_special_tokens=True)
    assert chunks[-1].num_prompt_tokens > 0
    load = backend.load()
    assert load.running == 0 and load.kv_blocks_used == 0 and load.stored_hashes
    assert backend.load().stored_hashes == []  # drained


async def test_concurrent_requests_and_prefix_cache_hits(backend: AsyncEngineBackend) -> None:
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = "the river runs under bridges of light while quiet engines hum " * 2
    first = await collect(backend, "warm", sampling, prompt=prompt)
    results = await asyncio.gather(
        *[collect(backend, f"r{i}", sampling, prompt=prompt) for i in range(4)]
    )
    want = [t for c in first for t in c.token_ids]
    for chunks in results:
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[-1].num_cached_tokens > 0


async def test_a_consumer_that_falls_behind_gets_coalesced_frames(
    backend: AsyncEngineBackend,
) -> None:
    """Outputs waiting when the consumer comes back arrive merged per choice, in order, with
    nothing lost: the same tokens, text and logprobs as a consumer that keeps up."""
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = {"prompt": "frames coalesce when the reader is slow"}
    steady = await collect(backend, "steady", sampling, **prompt)
    prepared = backend.prepare(sampling=sampling, prompt_token_ids=None, messages=None, **prompt)
    slow = []
    async for chunk in backend.generate("slow", prepared, sampling, "interactive"):
        slow.append(chunk)
        if len(slow) == 1:
            await asyncio.sleep(0.5)  # the engine runs on: eleven tokens wait
    # The steady consumer may itself fall one step behind now and then (a fast engine): only
    # the slow one's count is certain — its first chunk, then everything else merged.
    assert sum(len(c.token_ids) for c in steady) == 12 and len(slow) == 2
    for field in ("token_ids", "logprobs"):
        assert [x for c in slow for x in getattr(c, field)] == [
            x for c in steady for x in getattr(c, field)
        ]
    assert "".join(c.text for c in slow) == "".join(c.text for c in steady)
    assert slow[-1].finish_reason == "length" and all(c.finish_reason is None for c in slow[:-1])


async def test_prepare_validates(backend: AsyncEngineBackend) -> None:
    sp = SamplingParams(max_tokens=10)
    with pytest.raises(BackendError) as e:
        backend.prepare(prompt=None, prompt_token_ids=[1] * 250, messages=None, sampling=sp)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(BackendError) as e:
        backend.prepare(
            prompt=None,
            prompt_token_ids=None,
            messages=[ChatMessage("user", "x " * 300)],
            sampling=sp,
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(BackendError) as e:
        backend.prepare(prompt=None, prompt_token_ids=[10**6], messages=None, sampling=sp)
    assert e.value.code == "invalid_request"


async def test_abort_and_early_close_free_blocks(backend: AsyncEngineBackend) -> None:
    sampling = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    prepared = backend.prepare(
        prompt="hello strait", prompt_token_ids=None, messages=None, sampling=sampling
    )
    gen = backend.generate("x", prepared, sampling, "batch")
    await gen.__anext__()
    await gen.aclose()  # closing early aborts
    gen2 = backend.generate("y", prepared, sampling, "batch")
    await gen2.__anext__()
    backend.abort("y")
    rest = [c async for c in gen2]
    assert all(c.finish_reason is None for c in rest)
    for _ in range(100):
        if backend.load().kv_blocks_used == 0 and backend.load().running == 0:
            break
        await asyncio.sleep(0.02)
    load = backend.load()
    assert load.kv_blocks_used == 0 and load.running == 0


async def test_stop_strings_end_the_text_before_the_stop(backend: AsyncEngineBackend) -> None:
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    chunks = await collect(backend, "free", sampling, prompt="hello")
    full = "".join(c.text for c in chunks)
    stop = full[5:8]
    if not stop.strip() or full.index(stop) < 5:
        pytest.skip("generated text has no usable stop string")
    stopped = await collect(
        backend,
        "stopped",
        SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
        prompt="hello",
    )
    assert "".join(c.text for c in stopped) == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop"


async def test_compiled_decode_serves_from_the_engine_thread(tmp_path: Path) -> None:
    """engine.compile: graphs compiled while loading (off the event loop), then run by the
    engine thread; the tokens equal the eager engine's."""
    path = save_tiny_model_dir(tmp_path / "tiny")
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [f"request {i} asks about rivers and bridges" for i in range(3)]
    tokens: dict[bool, list[list[int]]] = {}
    for compile_ in (False, True):
        settings = EngineSettings(
            block_size=4,
            kv_cache_bytes=4 * 2**20,
            max_model_len=256,
            num_threads=1,
            cpu_kernels="on",
            compile=compile_,
            compile_background=False,  # compiled while loading, as strait up's warm-up does
        )
        b = AsyncEngineBackend(settings, str(path), "tiny")
        await b.start()
        try:
            results = await asyncio.gather(
                *[collect(b, f"r{i}", sampling, prompt=p) for i, p in enumerate(prompts)]
            )
            tokens[compile_] = [[t for c in chunks for t in c.token_ids] for chunks in results]
            runner = b._engine.runner  # type: ignore[union-attr]
            assert (runner.compiled_steps > 2) == compile_  # past the two warm-up calls
        finally:
            await b.stop()
    assert tokens[True] == tokens[False]
    assert all(len(t) == 8 for t in tokens[True])
