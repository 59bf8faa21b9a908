"""The load generator end to end against the fake streaming server of conftest.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from bench_fake_openai import FIRST_TOKEN_DELAY_S, TOKEN_GAP_S, TOKENS

from bench.serve import main, split_requests
from bench.serve_client import Sampling, Target, send_request
from bench.serve_run import Load, RunOptions, poisson_arrivals, run_load
from bench.workloads import generate

pytestmark = pytest.mark.unit

# Scheduling noise of two event loops on a shared machine; the delays themselves are exact.
SLACK_S = 0.1


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_one_request_times_first_token_and_every_gap(fake_server: str, api) -> None:
    (request,) = generate("chat", 1, max_tokens=100)
    async with httpx.AsyncClient() as client:
        record = await send_request(
            client, Target("fake", fake_server), "fake-model", api, request, Sampling(), 10.0
        )
    assert record.ok and record.status == 200, record.error_detail
    assert record.output_tokens == TOKENS and record.tokens_from_usage
    assert record.text_events == TOKENS  # the role-only chunk is not a token
    assert record.prompt_tokens == 11 and record.finish_reason == "length"
    assert record.ttft_s is not None
    assert FIRST_TOKEN_DELAY_S <= record.ttft_s < FIRST_TOKEN_DELAY_S + SLACK_S
    assert len(record.itl_s) == TOKENS - 1
    # A late read of the client can shorten one gap and lengthen another, never the sum below
    # what the server slept: the last token cannot arrive before it was sent.
    assert record.ttft_s + sum(record.itl_s) >= FIRST_TOKEN_DELAY_S + (TOKENS - 1) * TOKEN_GAP_S
    assert sum(record.itl_s) == pytest.approx((TOKENS - 1) * TOKEN_GAP_S, abs=SLACK_S)
    assert record.e2e_s == pytest.approx(record.ttft_s + sum(record.itl_s), abs=SLACK_S)


async def test_closed_loop_and_open_loop_send_every_request(fake_server: str) -> None:
    requests = generate("mixed", 12, seed=5)
    options = RunOptions("chat", Sampling(), duration_s=30, request_timeout_s=10, seed=5,
                         progress=False)  # fmt: skip
    target = Target("fake", fake_server)
    async with httpx.AsyncClient() as client:
        closed = await run_load(client, target, "m", requests, Load(concurrency=4), options)
        # 12 requests of >= 0.25 s, 4 at a time: three waves (one by one would take 3 s).
        assert 0.75 <= closed.duration_s < 1.5
        opened = await run_load(client, target, "m", requests, Load(rate=50.0), options)
    for run in (closed, opened):
        assert [r.index for r in run.records] == list(range(12))
        assert all(r.ok for r in run.records) and run.not_sent == 0
    scheduled = [r.scheduled_s for r in opened.records]
    assert scheduled == pytest.approx(poisson_arrivals(50.0, 12, seed=5))


async def test_the_duration_cap_stops_sending(fake_server: str) -> None:
    requests = generate("chat", 50)
    options = RunOptions("chat", Sampling(), duration_s=0.3, request_timeout_s=10, seed=0,
                         progress=False)  # fmt: skip
    async with httpx.AsyncClient() as client:
        run = await run_load(client, Target("f", fake_server), "m", requests, Load(2), options)
    # Two workers each send at 0 s and maybe again at ~0.25 s (if the first ended in time).
    assert 2 <= len(run.records) <= 4 and run.not_sent == 50 - len(run.records)
    assert all(r.start_s < 0.3 and r.ok for r in run.records)


async def test_a_model_list_names_the_models_in_turn(fake_server: str) -> None:
    """``model=A|B``: request i names the (i mod 2)th (the fake answers "overloaded" with 429)."""
    requests = generate("chat", 6)
    options = RunOptions("chat", Sampling(), duration_s=30, request_timeout_s=10, seed=0,
                         progress=False)  # fmt: skip
    async with httpx.AsyncClient() as client:
        run = await run_load(
            client, Target("f", fake_server), "m|overloaded", requests, Load(2), options
        )
    assert [r.ok for r in run.records] == [True, False] * 3


def test_poisson_arrivals_are_seeded_with_the_right_mean_gap() -> None:
    arrivals = poisson_arrivals(4.0, 2001, seed=1)
    assert arrivals == poisson_arrivals(4.0, 2001, seed=1) != poisson_arrivals(4.0, 2001, seed=2)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] / 2000 == pytest.approx(0.25, rel=0.1)


def test_no_request_is_sent_twice_to_a_target() -> None:
    # A server's exact-match response cache would answer a repeated greedy request.
    requests = generate("chat", 2 * 5 + 3)
    per_load, warm = split_requests(requests, 2, 3)
    assert per_load == [requests[:5], requests[5:10]] and warm == requests[10:]
    assert len({r.index for r in requests}) == 13


def test_main_compares_targets_and_writes_results(
    fake_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        f"--target=good={fake_server},key=sk-secret",
        f"--target=busy={fake_server},model=overloaded",
        "--workload=shared-prefix",
        "--prefix-words=300",
        "--rate=20,40",
        "--num-requests=6",
        "--slo-ttft-ms=1000",
        "--no-progress",
        f"--out={tmp_path}",
    ]
    assert main(argv) == 1  # every request to "busy" failed
    table = capsys.readouterr().out
    assert "good" in table and "http_429:6" in table
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {(r["target"], r["load"]): r for r in results["runs"]}
    good = runs[("good", "rate=20/s")]
    assert good["completed"] == 6 and good["output_tokens"] == 6 * TOKENS
    assert good["goodput"]["fraction"] == 1.0
    assert good["ttft_ms"]["p50"] == pytest.approx(FIRST_TOKEN_DELAY_S * 1000, abs=SLACK_S * 1000)
    assert runs[("busy", "rate=40/s")]["errors"] == {"http_429": 6}
    assert results["meta"]["models"] == {"good": "fake-model", "busy": "overloaded"}
    assert "sk-secret" not in (tmp_path / "results.json").read_text()
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * 6
    good_20 = [r["index"] for r in lines if r["target"] == "good" and r["load"] == "rate=20/s"]
    good_40 = [r["index"] for r in lines if r["target"] == "good" and r["load"] == "rate=40/s"]
    assert sorted(good_20) == list(range(6)) and sorted(good_40) == list(range(6, 12))
    assert {p.name for p in tmp_path.glob("*.png")} == {"latency_cdf.png", "sweep.png"}


def test_main_replays_a_trace_at_its_times_and_lengths(fake_server: str, tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = [(0.0, 12, 3), (0.3, 40, 5), (0.3, 7, 2)]
    trace.write_text(
        "".join(
            json.dumps({"t": t, "prompt_tokens": p, "max_tokens": m}) + "\n" for t, p, m in rows
        )
    )
    argv = [f"--target=good={fake_server}", f"--trace={trace}", "--no-progress", "--no-plots"]
    assert main([*argv, f"--out={tmp_path / 'out'}"]) == 0
    lines = [
        json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    ]
    assert sorted(r["index"] for r in lines) == [0, 1, 2]
    by_index = {r["index"]: r for r in lines}
    for i, (t, _, _) in enumerate(rows):
        assert by_index[i]["scheduled_s"] == t
        assert t <= by_index[i]["start_s"] < t + 5 * SLACK_S  # never early
    assert {r["load"] for r in lines} == {"trace=tiny"}
    with pytest.raises(SystemExit):
        main([*argv, "--rate=2"])
