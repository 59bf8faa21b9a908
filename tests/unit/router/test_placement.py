"""The placement cost on hand-built worker views."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from libs.registry import WorkerView
from services.router.placement import CostWeights, rank, worker_cost
from tests.unit.router.helpers import beat

pytestmark = pytest.mark.unit

W = CostWeights(overlap_weight=1.0, load_weight=1.0, prefill_norm_tokens=100, tie_epsilon=0.05)


def view(worker_id: str, running: int = 0, capacity: int = 10, block_size: int = 4) -> WorkerView:
    return WorkerView(
        beat=beat(worker_id, running=running, capacity=capacity, block_size=block_size), seen_at=0.0
    )


def test_cost_is_uncached_prefill_plus_decode_load() -> None:
    # 40-token prompt, 6 blocks of 4 held → 16 uncached tokens / 100; load 3/10.
    p = worker_cost(view("a", running=3), prompt_tokens=40, overlap_blocks=6, w=W)
    assert p.prefill_cost == pytest.approx(0.16)
    assert p.load_cost == pytest.approx(0.3)
    assert p.cost == pytest.approx(0.46)
    # Pending assignments count as load before the next beat shows them.
    v = view("b", running=3)
    v.pending_at += [1.0, 2.0]
    assert worker_cost(v, 40, 0, W).load_cost == pytest.approx(0.5)


def test_the_worker_holding_the_prefix_wins_at_equal_load() -> None:
    workers = [view("a", running=2), view("b", running=2), view("c", running=2)]
    ranked = rank(workers, 200, {"b": 40}, W, random.Random(0))
    assert ranked[0].worker.worker_id == "b" and ranked[0].overlap_blocks == 40


def test_load_outweighs_a_prefix_that_saves_less_work() -> None:
    # b holds 10 blocks (40 tokens = 0.4) but is 0.8 busier than a.
    workers = [view("a", running=0), view("b", running=8)]
    ranked = rank(workers, 200, {"b": 10}, W, random.Random(0))
    assert [p.worker.worker_id for p in ranked] == ["a", "b"]
    # With overlap weighted up, the prefix wins again.
    heavy = CostWeights(overlap_weight=3.0, load_weight=1.0, prefill_norm_tokens=100)
    assert rank(workers, 200, {"b": 10}, heavy, random.Random(0))[0].worker.worker_id == "b"


def test_near_ties_are_chosen_at_random_and_clear_winners_are_not() -> None:
    workers = [view(f"w{i}", running=1) for i in range(4)] + [view("busy", running=5)]
    rng = random.Random(7)
    firsts = Counter(rank(workers, 10, {}, W, rng)[0].worker.worker_id for _ in range(2000))
    assert set(firsts) == {"w0", "w1", "w2", "w3"}
    assert min(firsts.values()) > 400  # ~500 each: no herding onto the first listed
    # 0.04 apart is a tie (epsilon 0.05); 0.1 apart is not.
    near = [view("a", running=0, capacity=100), view("b", running=4, capacity=100)]
    assert {rank(near, 10, {}, W, rng)[0].worker.worker_id for _ in range(200)} == {"a", "b"}
    far = [view("a", running=0), view("b", running=1)]
    assert {rank(far, 10, {}, W, rng)[0].worker.worker_id for _ in range(200)} == {"a"}


def test_a_worker_whose_decode_rows_fill_its_itl_target_counts_as_loaded() -> None:
    """Few sequences but a step already at the pool's ITL target (engine.itl_target_ms): a new
    prompt there would run at the floor of min_prefill_tokens a step; the idler worker wins."""
    import msgspec

    saturated = msgspec.structs.replace(beat("busy", running=2), step_load=1.2)
    views = [
        WorkerView(beat=saturated, seen_at=0.0),
        WorkerView(beat=beat("idle", running=6), seen_at=0.0),
    ]
    assert views[0].load == pytest.approx(1.2) and views[1].load == pytest.approx(0.6)
    ranked = rank(views, 100, {}, CostWeights(), random.Random(0))
    assert [p.worker.worker_id for p in ranked] == ["idle", "busy"]
