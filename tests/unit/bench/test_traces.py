"""Traces for the planner and their replay: the file format, time compression, the prompts a
replay sends, and the open loop sending each request at its trace time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import traces
from bench.serve_run import Load, _open_loop
from bench.workloads import BenchRequest

pytestmark = pytest.mark.unit

SHIPPED = Path(__file__).resolve().parents[3] / "bench" / "traces"


def test_dump_and_load_round_trip_in_time_order(tmp_path: Path) -> None:
    items = [traces.Arrival(2.5, 40, 8), traces.Arrival(0.25, 12, 30)]
    path = tmp_path / "t.jsonl"
    traces.dump(items, path)
    assert traces.load(path) == sorted(items, key=lambda a: a.t)


def test_load_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"t": 0, "prompt_tokens": 4, "max_tokens": 4}\n\n{"t": 1, "prompt_tokens": 4}\n'
    )
    with pytest.raises(ValueError, match=r"t\.jsonl:3"):
        traces.load(path)
    path.write_text('{"t": -1, "prompt_tokens": 4, "max_tokens": 4}\n')
    with pytest.raises(ValueError, match=":1: t must be >= 0"):
        traces.load(path)


def test_compress_plays_the_same_shape_faster_at_the_same_rates() -> None:
    burst = traces.TRACES["burst"]
    k = 15.0
    items = traces.arrivals(burst, compress=k)
    start, end = 600.0 / k, 720.0 / k  # the 2-minute burst at 10:00, in compressed time
    inside = sum(start <= a.t < end for a in items) / (end - start)
    before = sum(a.t < start for a in items) / start
    assert items[-1].t < burst.duration_s / k
    assert inside == pytest.approx(10.0, rel=0.35)  # 10 req/s, Poisson over 8 s
    assert before == pytest.approx(1.0, rel=0.35)


def test_bench_requests_have_the_trace_lengths_and_no_shared_prefix() -> None:
    items = [traces.Arrival(0.0, 20, 7), traces.Arrival(1.0, 5, 64)]
    reqs = traces.bench_requests(items)
    assert [len(r.user.split()) for r in reqs] == [20, 5]
    assert [r.max_tokens for r in reqs] == [7, 64]
    assert reqs[0].user.split()[:2] != reqs[1].user.split()[:2]


def test_shipped_traces_load() -> None:
    names = {p.stem for p in SHIPPED.glob("*.jsonl")}
    assert {"steady", "diurnal", "burst", "ramp"} <= names
    for name in names:
        assert len(traces.load(SHIPPED / f"{name}.jsonl")) > 50


async def test_open_loop_sends_each_request_at_its_trace_time() -> None:
    offsets = (0.0, 0.05, 0.05, 0.15)
    reqs = [BenchRequest(i, "trace", None, "x", 4) for i in range(4)]
    sent: list[tuple[int, float | None, float]] = []
    start = time.perf_counter()

    async def one(request: BenchRequest, scheduled: float | None) -> None:
        sent.append((request.index, scheduled, time.perf_counter() - start))

    load = Load(arrivals=offsets, trace_name="t")
    assert load.label == "trace=t"
    await _open_loop(reqs, load, 0, start, start + 10, one)
    assert [(i, s) for i, s, _ in sent] == list(enumerate(offsets))
    # Never early (late only by the event loop's wake-up: loose, the machine is shared).
    assert all(s is not None and s <= at < s + 0.5 for _, s, at in sent)


def test_trace_arrivals_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="time order"):
        Load(arrivals=(1.0, 0.5))
