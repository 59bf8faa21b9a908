"""The worker registry: beats, expiry, KV-event block index, pending assignments."""

from __future__ import annotations

import pytest

from libs.protocol import KvEvent, WorkerStarting
from libs.registry import WorkerRegistry
from tests.unit.router.helpers import beat, hold

pytestmark = pytest.mark.unit


def test_a_worker_that_misses_beats_is_dropped_with_its_blocks() -> None:
    r = WorkerRegistry(ttl_s=1.0)
    r.on_beat(beat("a"), now=100.0)
    r.on_beat(beat("b"), now=100.0)
    hold(r, "a", [1, 2])
    r.on_beat(beat("b"), now=100.8)
    assert {v.worker_id for v in r.live("default", now=101.05)} == {"b"}
    assert r.expire(now=101.05) == ["a"]
    assert set(r.workers) == {"b"} and r.holders == {}
    assert r.overlaps([1, 2]) == {}


def test_after_the_router_was_cut_off_every_worker_gets_a_fresh_ttl() -> None:
    """The router's own NATS connection was down: the silence says nothing about the workers,
    so none expires until a whole TTL after it is back."""
    r = WorkerRegistry(ttl_s=1.0)
    r.on_beat(beat("a"), now=100.0)
    r.refresh(now=102.0)  # reconnected at 102 s, two TTLs after the last beat
    assert r.expire(now=102.9) == []
    assert r.expire(now=103.1) == ["a"]


def test_draining_and_other_pools_are_not_live() -> None:
    r = WorkerRegistry(ttl_s=10.0)
    r.on_beat(beat("a", draining=True))
    r.on_beat(beat("b", pool="large"))
    assert r.live("default") == [] and len(r.live("large")) == 1


def test_overlap_is_the_held_leading_chain() -> None:
    r = WorkerRegistry(ttl_s=10.0)
    for w in "abcd":
        r.on_beat(beat(w))
    hold(r, "a", [1, 2, 3])
    hold(r, "b", [1, 2])
    hold(r, "c", [2, 3])  # not the first block: no usable prefix
    assert r.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 2}
    r.on_kv_event(KvEvent(worker_id="a", model="m", evicted=[2]))
    assert r.overlaps([1, 2, 3]) == {"a": 1, "b": 2}
    r.on_kv_event(KvEvent(worker_id="b", model="m", cleared=True, stored=[9]))
    assert r.overlaps([1, 2, 3]) == {"a": 1} and r.overlaps([9]) == {"b": 1}


def test_pending_assignments_last_until_a_beat_can_show_them() -> None:
    r = WorkerRegistry(ttl_s=10.0)
    r.on_beat(beat("a"), now=0.0)
    r.on_assigned("a", now=0.1)
    r.on_beat(beat("a", running=1), now=0.2)  # may have been sent before the assignment landed
    assert r.workers["a"].pending == 1
    r.on_assigned("a", now=0.3)
    r.on_beat(beat("a", running=2), now=0.4)  # a full period later: the first is counted
    assert r.workers["a"].pending == 1
    assert r.workers["a"].load == pytest.approx(0.3)


def test_a_worker_is_expected_while_unheard_since_start_or_lost_without_draining() -> None:
    """``returning_until``: one TTL after the registry starts (no beat heard yet is not no
    worker); ``return_wait_s`` after a worker was lost without draining, also before the sweep
    dropped it; never for a worker that drained away or for another pool."""
    r = WorkerRegistry(ttl_s=1.0, return_wait_s=30.0)
    start = r.started_at
    assert r.returning_until(["default"], now=start + 0.5) == start + 1.0
    assert r.returning_until(["default"], now=start + 1.0) == 0.0
    t = start + 10.0
    r.on_beat(beat("a"), now=t)
    r.on_beat(beat("b", draining=True), now=t)
    # a's TTL ran out, the sweep has not dropped it yet: already expected back.
    assert r.returning_until(["default"], now=t + 1.2) == t + 1.0 + 30.0
    assert r.expire(now=t + 1.2) == ["a", "b"]
    assert set(r.lost) == {"a"}
    assert r.returning_until(["default"], now=t + 20.0) == t + 1.2 + 30.0
    assert r.returning_until(["other"], now=t + 20.0) == 0.0
    r.on_beat(beat("a"), now=t + 21.0)  # back: no longer waited for
    assert r.lost == {} and r.workers["a"].joined_at == t + 21.0
    r.expire(now=t + 40.0)
    assert r.returning_until(["default"], now=t + 40.0 + 29.0) > 0
    assert r.returning_until(["default"], now=t + 40.0 + 31.0) == 0.0
    assert r.expire(now=t + 40.0 + 31.0) == [] and r.lost == {}


def starting(
    stage: str, stage_s: float, worker: str = "a", pool: str = "default"
) -> WorkerStarting:
    return WorkerStarting(
        worker_id=worker, pool=pool, role="aggregated", stage=stage, stage_s=stage_s
    )  # type: ignore[arg-type]


def test_a_starting_worker_is_waited_for_while_it_makes_progress() -> None:
    """A restarted worker that announces its stages keeps its pool awaited past
    ``return_wait_s`` as long as its announcements come and no stage lasts past ``stall_s``;
    one that stalls, or falls silent for a TTL, is given up on; its first beat ends the wait."""
    r = WorkerRegistry(ttl_s=1.0, return_wait_s=30.0, stall_s=120.0)
    t = r.started_at + 10.0
    r.on_beat(beat("a"), now=t)
    r.expire(now=t + 1.2)  # lost at t + 1.2: awaited until t + 31.2
    for i, stage in enumerate(["loading_model"] * 40 + ["loading_kernels"] * 40):
        now = t + 5.0 + i
        r.on_starting(starting(stage, stage_s=float(i % 40)), now=now)
        r.expire(now=now)
        # The lost window (30 s), and past it one TTL after each announcement.
        assert r.returning_until(["default"], now=now) == pytest.approx(max(t + 31.2, now + 1))
    assert r.returning_until(["other"], now=t + 84.0) == 0.0
    now = t + 85.0  # still loading_kernels, held for 121 s: it stopped making progress
    r.on_starting(starting("loading_kernels", stage_s=121.0), now=now)
    assert r.returning_until(["default"], now=now) == 0.0
    r.on_starting(starting("loading_graphs", stage_s=0.2), now=now + 0.5)  # it moved on
    assert r.returning_until(["default"], now=now + 0.5) == now + 1.5
    assert r.returning_until(["default"], now=now + 1.6) == 0.0  # silent for a TTL
    r.expire(now=now + 1.6)
    assert r.starting == {}
    r.on_starting(starting("loading_graphs", stage_s=1.0), now=now + 2.0)
    r.on_beat(beat("a"), now=now + 2.5)  # serving: nothing left to wait for
    assert r.starting == {} and len(r.live("default", now=now + 2.5)) == 1


def test_a_standby_loading_or_loaded_is_not_a_worker_coming() -> None:
    r = WorkerRegistry(ttl_s=1.0, return_wait_s=30.0, stall_s=120.0)
    now = r.started_at + 10.0
    r.on_starting(starting("standby", stage_s=3.0), now=now)
    assert r.starting == {} and r.returning_until(["default"], now=now) == 0.0
