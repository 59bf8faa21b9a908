"""The fair share alone and inside the engine's scheduler (no model): shares of output tokens
between flooding tenants, a tenant that comes back from idle, bands, and a seat for a tenant
with none running."""

from __future__ import annotations

import itertools

import pytest

from libs.engine.block_pool import BlockPool
from libs.engine.fair import FairShare
from libs.engine.kv_manager import KvManager
from libs.engine.scheduler import Scheduler
from libs.engine.sequence import Sequence
from libs.protocol import Priority, SamplingParams
from libs.settings import EngineSettings

pytestmark = pytest.mark.unit

_ids = itertools.count()


def make(**kw: object) -> Scheduler:
    settings = EngineSettings(block_size=4, max_num_batched_tokens=256, **kw)  # type: ignore[arg-type]
    return Scheduler(settings, KvManager(BlockPool(4096, 4), "m"))


def seq(
    tenant: str, weight: float = 1.0, n_prompt: int = 8, priority: Priority = "interactive"
) -> Sequence:
    rid = f"{tenant}-{next(_ids)}"
    first = 1000 * next(_ids)
    s = Sequence(rid, 0, list(range(first, first + n_prompt)), n_prompt, SamplingParams(), priority)
    s.tenant, s.weight = tenant, weight
    return s


def step(s: Scheduler, answer: int, served: dict[str, int]) -> list[Sequence]:
    """One schedule and a pretend forward; sequences with ``answer`` output tokens finish.
    Returns the finished ones; ``served`` counts output tokens by tenant."""
    out = s.schedule()
    done = []
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        s.kv.commit(item.seq)
        if samples:
            item.seq.append_token(7)
            served[item.seq.tenant] = served.get(item.seq.tenant, 0) + 1
            if item.seq.num_output_tokens >= answer:
                done.append(item.seq)
    for d in done:
        s.remove(d)
    return done


def flood(
    s: Scheduler, weights: dict[str, float], steps: int, answer: int = 12, backlog: int = 3
) -> dict[str, int]:
    """Every tenant keeps requests open (the first ``backlog`` x max_num_seqs, the others
    a third of that, each answered request replaced by a new one); output tokens served by
    tenant over ``steps`` steps after a warm-up of as many."""
    for i, (t, w) in enumerate(weights.items()):
        for _ in range(s.max_num_seqs * backlog // (1 if i == 0 else 3)):
            s.add(seq(t, w))
    served: dict[str, int] = {}
    for i in range(2 * steps):
        if i == steps:
            served = {}
        for d in step(s, answer, served):
            s.add(seq(d.tenant, d.weight))
    return served


def test_counter_is_lifted_to_the_floor_and_keeps_its_debt() -> None:
    f = FairShare(prompt_cost=0.5, max_idle=1)
    f.enter("a")
    f.charge("a", prompt_tokens=100, output_tokens=10)
    assert f.counter("a") == 60
    f.enter("b", weight=2)
    assert f.counter("b") == 60  # no credit for having been away
    f.charge("b", output_tokens=10)
    assert f.counter("b") == 65  # tokens over weight
    f.leave("b")
    f.charge("a", output_tokens=100)
    f.enter("b", weight=2)
    assert f.counter("b") == 160  # lifted to a's
    f.charge("b", output_tokens=400)
    f.leave("b")
    f.enter("b", weight=2)
    assert f.counter("b") == 360  # leaving for a moment erased no debt
    f.leave("a")
    assert "a" not in f.counters and f.share("b") == 1.0
    f.leave("b")
    assert list(f.idle) == ["b"]  # bounded: a's counter was forgotten


@pytest.mark.parametrize(("weights", "want"), [((1, 1), 0.5), ((3, 1), 0.75)])
def test_flooding_tenants_get_their_weighted_share(
    weights: tuple[float, float], want: float
) -> None:
    s = make(max_num_seqs=8)
    served = flood(s, {"a": weights[0], "b": weights[1]}, steps=400)
    share = served["a"] / (served["a"] + served["b"])
    assert abs(share - want) < 0.05, served


def test_without_fair_share_the_tenant_with_more_open_requests_takes_more() -> None:
    s = make(max_num_seqs=8, fair_share=False)
    served = flood(s, {"a": 1, "b": 1}, steps=400)
    assert served["a"] / (served["a"] + served["b"]) > 0.7  # what the fair share is for


def test_a_tenant_back_from_idle_gets_its_share_not_a_burst() -> None:
    s = make(max_num_seqs=8)
    flood(s, {"a": 1}, steps=200)  # a alone: work-conserving, every seat
    for _ in range(3 * s.max_num_seqs):
        s.add(seq("b"))
    served: dict[str, int] = {}
    for _ in range(100):
        for d in step(s, 12, served):
            s.add(seq(d.tenant))
    # b starts at a's counter: it catches up to half, it does not take the worker back.
    assert 0.35 < served["b"] / (served["a"] + served["b"]) < 0.65, served


def test_bands_before_counters() -> None:
    s = make(max_num_seqs=1, fair_headroom_seqs=0)
    s.add(seq("heavy", priority="batch"))
    s.add(seq("light", priority="standard"))
    s.add(seq("light2", priority="interactive"))
    served: dict[str, int] = {}
    step(s, 1, served)
    assert list(served) == ["light2"]
    step(s, 1, served)
    assert list(served) == ["light2", "light"]


def test_a_tenant_with_nothing_running_gets_a_seat_at_once() -> None:
    s = make(max_num_seqs=4, fair_headroom_seqs=1)
    served: dict[str, int] = {}
    for _ in range(8):
        s.add(seq("flood"))
    step(s, 100, served)
    quiet = seq("quiet")
    s.add(quiet)
    step(s, 100, served)
    assert quiet in s.running and len(s.running) == 5  # the headroom seat
    second = seq("other")
    s.add(second)
    step(s, 100, served)
    assert second not in s.running  # headroom taken, no preemption: it waits its turn


def test_fair_preemption_takes_the_seat_of_the_tenant_over_its_share() -> None:
    s = make(max_num_seqs=4, fair_headroom_seqs=0, fair_preempt=True)
    served: dict[str, int] = {}
    for _ in range(8):
        s.add(seq("flood"))
    step(s, 100, served)
    quiet = seq("quiet")
    s.add(quiet)
    step(s, 100, served)
    assert quiet in s.running and len(s.running) == 4
    assert s.num_fair_preemptions == 1
    assert sum(x.tenant == "flood" for x in s.running) == 3


def test_a_newcomers_first_prompt_runs_alone_at_most_every_n_steps() -> None:
    s = make(max_num_seqs=4, fair_first_prompt_alone_every=3)
    served: dict[str, int] = {}
    for _ in range(4):
        s.add(seq("flood"))
    for _ in range(3):
        step(s, 100, served)
    quiet = seq("quiet")
    s.add(quiet)
    out = s.schedule()
    assert [x.seq for x in out.scheduled] == [quiet]  # the flood's rows sit out this step
    for x in out.scheduled:
        x.seq.num_computed_tokens += x.num_new_tokens
        x.seq.append_token(7)
    other = seq("other")
    s.add(other)
    out = s.schedule()  # one step later: a newcomer shares the step (not alone again yet)
    assert other in [x.seq for x in out.scheduled] and len(out.scheduled) == 6
    assert s.num_alone_steps == 1
    off = make(max_num_seqs=4, fair_first_prompt_alone_every=0)
    for _ in range(4):
        off.add(seq("flood"))
    step(off, 100, served)
    off.add(seq("quiet"))
    assert len(off.schedule().scheduled) == 5


def test_shared_seats_shorten_steps_only_while_another_tenant_is_present() -> None:
    """``fair_shared_max_num_seqs``: a lone flood runs every seat; once a light tenant (one
    request at a time) is present the flood is seated only up to the shared seats (its answers
    drain the batch down, nobody preempted), and a step carries at most those rows plus the
    newcomer's; two floods keep every seat; when the light tenant has been gone past the window
    the flood gets every seat back."""
    now = [0.0]
    settings = EngineSettings(
        block_size=4, max_num_batched_tokens=256, max_num_seqs=16,
        fair_shared_max_num_seqs=4, fair_shared_window_s=5.0, fair_headroom_seqs=1,
    )  # fmt: skip
    s = Scheduler(settings, KvManager(BlockPool(4096, 4), "m"), clock=lambda: now[0])
    served: dict[str, int] = {}

    def keep_flooding() -> None:
        while sum(1 for q in s._waiting if not q.is_finished) < 8:
            s.add(seq("flood"))

    alone = []
    for _ in range(6):
        keep_flooding()
        step(s, 6, served)
        alone.append(s.num_running)
    assert s.seats() == 16 and max(alone) == 16  # alone: every seat
    quiet = seq("quiet")
    s.add(quiet)
    rows = []
    for _ in range(30):
        keep_flooding()
        now[0] += 0.05
        step(s, 6, served)
        rows.append(s.num_running)
    assert s.seats() == 4
    assert quiet.is_finished or quiet in s.running  # seated at once (headroom), not queued
    assert max(rows[-10:]) <= 4 + 1  # drained to the shared seats, plus the headroom seat
    assert s.num_preemptions == 0
    other = [seq("other") for _ in range(3)]  # a second flood: no tenant light but quiet
    for o in other:
        s.add(o)
    assert s.seats() == 4  # quiet is still within the window
    now[0] += 10.0  # the quiet tenant gone past the window: floods only, every seat again
    assert s.seats() == 16
    for o in other:
        s.remove(o)
    now[0] += 10.0
    again = []
    for _ in range(12):
        keep_flooding()
        step(s, 6, served)
        again.append(s.num_running)
    assert s.seats() == 16 and max(again) == 16
