"""``strait up``'s compile warm-up: which pools it warms and when a warm-up goes stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.support.tiny_models import save_tiny_model_dir
from libs.models import warm
from libs.settings import EngineSettings, PoolSettings, Settings

pytestmark = pytest.mark.unit


def _settings(tmp_path: Path, model_dir: Path, **engine: object) -> Settings:
    return Settings(
        state_dir=str(tmp_path / "state"),
        engine=EngineSettings(**engine),
        pools=[PoolSettings(name="p", model=str(model_dir))],
    )


def test_a_pool_is_warmed_once_per_graph_shaping_change(tmp_path: Path) -> None:
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    s = _settings(tmp_path, model_dir, compile=True)
    pool = s.pools[0]
    assert warm.needs_warm(s, pool)
    marker = warm._marker(s, pool, model_dir)
    assert marker.parent == s.compile_cache_dir
    marker.parent.mkdir(parents=True)
    marker.touch()
    assert not warm.needs_warm(s, pool)
    # The KV budget is a symbolic size of the graphs: no new warm-up.
    budget = _settings(tmp_path, model_dir, compile=True, kv_cache_bytes=2**30)
    assert not warm.needs_warm(budget, budget.pools[0])
    # Speculation runs the same graphs (the warm-up compiles without it): no new warm-up.
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    deeper = _settings(tmp_path, model_dir, compile=True, speculative=spec)
    assert not warm.needs_warm(deeper, deeper.pools[0])
    # The weights' format, the thread count or the model's config: a new one.
    for changed in ({"quantization": "int8"}, {"num_threads": 1}):
        other = _settings(tmp_path, model_dir, compile=True, **changed)
        assert warm.needs_warm(other, other.pools[0]), changed
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    assert warm.needs_warm(s, pool)


def test_pools_that_do_not_compile_are_not_warmed(tmp_path: Path) -> None:
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    eager = _settings(tmp_path, model_dir, compile=False)
    assert not warm.needs_warm(eager, eager.pools[0])
    fake = Settings(
        state_dir=str(tmp_path / "state"),
        engine=EngineSettings(compile=True),
        pools=[PoolSettings(name="f", model="fake-model", backend="fake")],
    )
    assert not warm.needs_warm(fake, fake.pools[0])


def test_num_threads_resolves_and_keys_the_warm_marker(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """-1 is every core but one (at least one); the resolved count is part of the warm key, so a
    worker that would run another thread count never trusts graphs built for this one."""
    import os

    from libs.settings import EngineSettings

    cores = len(os.sched_getaffinity(0))
    assert EngineSettings(num_threads=-1).threads() == max(1, cores - 1)
    assert EngineSettings(num_threads=3).threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0})
    assert EngineSettings(num_threads=-1).threads() == 1
    # The same settings resolving to another count (OMP_NUM_THREADS, another machine): a new key.
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    s = _settings(tmp_path, model_dir, compile=True)
    before = warm.warm_key(s, s.pools[0], model_dir)
    monkeypatch.setattr(EngineSettings, "threads", lambda self: 7)
    assert warm.warm_key(s, s.pools[0], model_dir) != before


def test_seats_key_the_graphs_only_on_a_cuda_device() -> None:
    """``max_num_seqs`` sizes CUDA graphs' batch buckets; a CPU's compiled forward is dynamic
    in its rows, so changing it there keeps the saved graphs (no recompile on a restart)."""
    from libs.engine.digest import engine_digest

    cpu64, cpu16 = EngineSettings(max_num_seqs=64), EngineSettings(max_num_seqs=16)
    assert engine_digest(cpu64) == engine_digest(cpu16)
    assert engine_digest(cpu64) != engine_digest(EngineSettings(max_num_seqs=64, block_size=32))
    cuda = {"device": "cuda"}
    assert engine_digest(EngineSettings(max_num_seqs=64, **cuda)) != engine_digest(
        EngineSettings(max_num_seqs=16, **cuda)
    )


def test_the_warm_up_budget_leaves_the_kv_cache_its_bytes_beside_lora_slots(
    tmp_path: Path,
) -> None:
    """A pool with LoRA slots warms: the slots take their bytes out of the engine's KV budget
    first, so the warm-up's budget is ``WARM_KV_BYTES`` plus at least what they take (on
    SmolLM2, 4 slots of rank 16 are 78 MB: more than the whole warm-up budget was)."""
    import torch
    from transformers import AutoModelForCausalLM

    from libs.engine.lora.layers import bank_bytes

    model_dir = save_tiny_model_dir(tmp_path / "m")
    plain = EngineSettings()
    assert warm.warm_kv_bytes(model_dir, plain) == warm.WARM_KV_BYTES
    slots = EngineSettings(max_loras=4, max_lora_rank=16)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    taken = bank_bytes(model, slots, torch.float32)
    assert taken > 0
    assert warm.warm_kv_bytes(model_dir, slots) - warm.WARM_KV_BYTES >= taken
