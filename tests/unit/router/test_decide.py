"""Router.decide on hand-built registries: pool choice, spill-over, reasons, prefix placement."""

from __future__ import annotations

import random

import pytest

from libs.backend.fake import FakeBackend
from libs.protocol import SamplingParams
from libs.registry import WorkerRegistry
from libs.settings import FakeEngineSettings, PoolSettings, Settings
from services.router.decision import Decision, Rejection
from services.router.router import Router
from tests.unit.router.helpers import beat, hold, registry, request

pytestmark = pytest.mark.unit

SMALL, LARGE = "smollm2-135m-instruct", "gemma3-270m"


def two_pools() -> Settings:
    s = Settings()
    s.pools = [
        PoolSettings(name="small", model=SMALL, backend="fake"),
        PoolSettings(name="large", model=LARGE, backend="fake"),
    ]
    return s


def router(s: Settings, reg: WorkerRegistry) -> Router:
    return Router(None, None, s, reg, rng=random.Random(0))  # type: ignore[arg-type]


def decided(r: Router, req: object, **kw: object) -> Decision:
    d = r.decide(req, **kw)  # type: ignore[arg-type]
    assert isinstance(d, Decision), d
    return d


def fleet(**busy: int) -> WorkerRegistry:
    return registry(
        beat("s1", pool="small", model=SMALL, running=busy.get("s1", 0)),
        beat("s2", pool="small", model=SMALL, running=busy.get("s2", 0)),
        beat("l1", pool="large", model=LARGE, running=busy.get("l1", 0)),
    )


def test_auto_is_classified_and_the_reason_says_why() -> None:
    r = router(two_pools(), fleet())
    easy = decided(r, request("hi"))
    assert (easy.pool, easy.code, easy.score, easy.factors) == ("small", "auto_small", 0.0, [])
    hard = decided(r, request("Prove this theorem step by step", max_tokens=600))
    assert (hard.pool, hard.code) == ("large", "auto_large")
    assert hard.factors == ["long_output", "math", "multi_step"] and hard.score == 1.5
    route = hard.route(hard.ranked[0])
    assert route.worker_id == "l1" and route.code == "auto_large" and route.cost is not None
    assert "math" in route.factors and any(f.startswith("load=") for f in route.factors)


def test_an_explicit_pool_or_model_wins_over_the_classifier() -> None:
    r = router(two_pools(), fleet())
    hard = "Prove this theorem step by step"
    assert (decided(r, request(hard, model="small")).code) == "explicit_pool"
    d = decided(r, request("hi", model=LARGE))
    assert (d.pool, d.code, d.score) == ("large", "explicit_model", None)
    rej = r.decide(request("hi", model="gpt-9"))
    assert isinstance(rej, Rejection) and rej.code == "model_not_found"


def test_one_pool_takes_everything() -> None:
    reg = registry(beat("w1"))
    d = decided(router(Settings(), reg), request("Prove it step by step"))
    assert (d.pool, d.code) == ("default", "auto_single_pool")


def test_no_live_worker_spills_to_an_allowed_pool_or_answers_no_worker() -> None:
    s = two_pools()
    reg = registry(beat("s1", pool="small", model=SMALL))
    d = decided(router(s, reg), request("Prove this theorem step by step", max_tokens=600))
    assert (d.pool, d.code) == ("small", "spill_over") and "no_live_worker:large" in d.factors
    # An explicit pool only spills to pools serving the same model: none here.
    rej = router(s, reg).decide(request("hi", model="large"))
    assert isinstance(rej, Rejection) and rej.code == "no_worker" and rej.retry_after_s == 2.0
    s.router.spill_over = False
    rej = router(s, reg).decide(request("Prove this theorem step by step", max_tokens=600))
    assert isinstance(rej, Rejection) and "spill_over" in rej.message


def test_saturation_spill_is_a_policy() -> None:
    s = two_pools()
    reg = fleet(s1=10, s2=10)
    assert decided(router(s, reg), request("hi")).pool == "small"  # off by default
    s.router.saturation_spill = True
    d = decided(router(s, reg), request("hi"))
    assert (d.pool, d.code) == ("large", "spill_saturated") and "saturated:small" in d.factors


def test_a_deep_queue_is_refused_naming_the_setting() -> None:
    s = two_pools()
    s.router.max_pool_queue = 5
    reg = registry(beat("s1", pool="small", model=SMALL, waiting=5))
    rej = router(s, reg).decide(request("hi", model="small"))
    assert isinstance(rej, Rejection) and rej.code == "no_capacity"
    assert "router.max_pool_queue" in rej.message


def test_the_prompt_goes_to_the_worker_holding_its_prefix() -> None:
    s = two_pools()
    reg = registry(*(beat(f"s{i}", pool="small", model=SMALL, block_size=16) for i in range(8)))
    prompt = " ".join(f"w{i}" for i in range(200))
    fake = FakeBackend(FakeEngineSettings(), model_name=SMALL, block_size=16)
    ids = fake.prepare(
        prompt=prompt, prompt_token_ids=None, messages=None, sampling=SamplingParams()
    )
    hold(reg, "s5", fake.block_hashes(ids.token_ids))
    d = decided(router(s, reg), request(prompt + " and a new question", model="small"))
    assert d.ranked[0].worker.worker_id == "s5" and d.ranked[0].overlap_blocks == 12


def test_lost_workers_are_excluded() -> None:
    r = router(two_pools(), fleet())
    d = decided(r, request("hi"), exclude=frozenset({"s1"}))
    assert [p.worker.worker_id for p in d.ranked] == ["s2"]


def test_the_two_pool_config_file_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRAIT_CONFIG", "configs/two-pools.toml")
    s = Settings()
    assert [(p.name, p.model, p.backend) for p in s.pools] == [
        ("small", SMALL, "engine"),
        ("large", LARGE, "engine"),
    ]
    assert (s.router.small_pool, s.router.large_pool) == ("small", "large")


def test_a_disaggregated_pool_gets_a_prefill_worker_and_decode_workers_by_load() -> None:
    s = Settings()
    s.pools = [PoolSettings(name="dis", model=SMALL, mode="disaggregated")]
    reg = registry(
        beat("p1", pool="dis", model=SMALL, role="prefill"),
        beat("d1", pool="dis", model=SMALL, role="decode", running=8),
        beat("d2", pool="dis", model=SMALL, role="decode", running=1),
    )
    d = decided(router(s, reg), request("hi", model="dis"))
    assert [p.worker.worker_id for p in d.ranked] == ["p1"]  # decode workers never prefill
    assert d.decode_workers == ["d2", "d1"]
    assert reg.serving_pools() == {"dis"}


def test_a_disaggregated_pool_without_a_decode_worker_answers_no_worker() -> None:
    s = Settings()
    s.pools = [PoolSettings(name="dis", model=SMALL, mode="disaggregated")]
    reg = registry(beat("p1", pool="dis", model=SMALL, role="prefill"))
    rej = router(s, reg).decide(request("hi", model="dis"))
    assert isinstance(rej, Rejection) and rej.code == "no_worker"
    assert "decode" in rej.message
    assert reg.serving_pools() == set()
