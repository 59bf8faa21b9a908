"""The fault campaign's helpers (bench/chaos/): no fleet, no NATS."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.chaos.campaign import table
from bench.chaos.faults import malformed_payloads
from bench.chaos.fleet import Opts, PrivatePostgres, parse_metric
from bench.chaos.load import Call, Load, reference
from bench.chaos.measure import ledger_vs_events
from bench.support.nats_servers import NatsCluster
from libs.protocol import GenerateRequest, ProtocolError, UsageEvent, decode

pytestmark = pytest.mark.unit

VALID = {"v": 1, "request_id": "junk", "model": "m", "prompt": "x", "sampling": {"max_tokens": 2}}


def test_parse_metric_sums_labelled_samples_and_skips_longer_names() -> None:
    text = (
        "# TYPE strait_worker_running_requests gauge\n"
        "strait_worker_running_requests 3.0\n"
        'strait_gateway_migrations_total{pool="a"} 2.0\n'
        'strait_gateway_migrations_total{pool="b"} 1.0\n'
        "strait_gateway_migrations_total_created 1.7e9\n"
    )
    assert parse_metric(text, "strait_worker_running_requests") == 3.0
    assert parse_metric(text, "strait_gateway_migrations_total") == 3.0
    assert parse_metric(text, "absent") == 0.0


def test_nearest_rank() -> None:
    from bench.stats import nearest_rank

    assert nearest_rank([], 0.5) is None
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert nearest_rank([3.0, 1.0, 2.0], 1.0) == 3.0


def test_malformed_payloads_are_refused_by_the_decoder() -> None:
    payloads = malformed_payloads(random.Random(1), VALID, 600, oversized=False)
    assert len(payloads) == 600
    refused = 0
    for p in payloads:
        try:
            decode(p, GenerateRequest)
        except (ProtocolError, TypeError):  # TypeError: a `v` the decoder cannot hash
            refused += 1
    # A few wrong-typed fields are still valid requests (e.g. "sampling": {} is all defaults).
    assert refused >= 0.95 * len(payloads)
    assert max(len(p) for p in payloads) < 2**20
    big = malformed_payloads(random.Random(1), VALID, 600, oversized=True)
    assert max(len(p) for p in big) >= 2**20


async def test_reference_is_the_fake_engines_deterministic_answer() -> None:
    a = await reference("Write a haiku about the number 3.", 3, 20)
    assert a == await reference("Write a haiku about the number 3.", 3, 20)
    assert len(a.split()) == 20
    assert a != await reference("Write a haiku about the number 3.", 4, 20)


def test_sse_events_fill_a_call() -> None:
    load = Load.__new__(Load)
    c = Call(0, "http", seed=0)

    def ev(obj: object) -> bytes:
        return b"data: " + json.dumps(obj).encode()

    delta = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    assert not load.on_event(c, ev(delta))
    assert not load.on_event(
        c, ev({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    )
    assert not load.on_event(c, ev({"choices": [], "usage": {"completion_tokens": 1}}))
    assert load.on_event(c, b"data: [DONE]")
    assert (c.texts, c.usage, c.status) == (["a"], 1, "ok")
    err = Call(1, "http", seed=1)
    assert load.on_event(err, ev({"error": {"code": "worker_lost", "message": "gone"}}))
    assert (err.status, err.error) == ("failed", "sse worker_lost")


def test_table_has_one_row_per_scenario() -> None:
    row = {
        "scenario": "kill-worker",
        "streams": 40,
        "requests": 100,
        "completed": 99,
        "migrated": 10,
        "failed": 1,
        "failed_by": {"sse worker_lost": 1},
        "hangs": 0,
        "bad_text": 0,
        "ledger_lost": 0,
        "ledger_wrong": 0,
        "held_after_total": 0,
        "crashed": [],
        "router_consumer": {"ack_pending": 0},
        "stalled": 10,
        "open_at_fault": 40,
        "stall_s": [1.4, 1.5],
        "ttft_after_s": [0.01, None],
    }
    lines = table([row]).splitlines()
    assert len(lines) == 3
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| kill-worker | 40 | 100 | 99 | 10 | 1 (sse worker_lost: 1) |" in lines[2]
    assert "1.40 / 1.50" in lines[2] and "0.01 / –" in lines[2]


def test_table_renders_a_skipped_scenario_with_every_column() -> None:
    lines = table([{"scenario": "postgres-outage", "skipped": "no initdb"}]).splitlines()
    assert lines[0].count("|") == lines[2].count("|")
    assert lines[2].startswith("| postgres-outage | skipped: no initdb |")


def test_ledger_vs_events_finds_lost_extra_and_overwritten_rows() -> None:
    def ev(rid: str, source: str, at: float, n: int = 120) -> UsageEvent:
        return UsageEvent(request_id=rid, source=source, finished_at=at, completion_tokens=n)

    events = [
        (1, ev("a", "gateway", 10.0)),
        (2, ev("a", "worker", 9.0)),  # later in the stream, older: must not win
        (3, ev("b", "worker", 5.0)),
        (4, ev("b", "gateway", 6.0)),
        (5, ev("c", "nats-client", 7.0, n=3)),
        (6, ev("d", "worker", 8.0)),
    ]
    rows = {
        "a": ("ok", 120, "worker"),
        "b": ("ok", 120, "gateway"),
        "c": ("ok", 120, "nats-client"),
        "x": ("ok", 120, "gateway"),
    }
    got = ledger_vs_events(rows, events, {"a", "b", "c", "d"})
    assert got["usage_events"] == 6 and got["usage_event_request_ids"] == 4
    assert got["events_without_row_ids"] == ["d"] and got["rows_without_event"] == 1
    assert got["rows_tokens_differ_from_latest_event"] == 1  # c: 3 in the event, 120 in the row
    assert got["rows_worker_event_over_later_client_event_ids"] == ["a"]
    assert got["of_those_worker_event_later_in_stream"] == 1
    assert got["ledger_rows_of_load"] == 3


def test_nats_cluster_configs_route_to_the_other_servers(tmp_path: Path) -> None:
    c = NatsCluster(tmp_path, n=3)
    try:
        assert c.url.count(",") == 2 and c.live_url == ""
        for i, conf in enumerate(c.confs):
            text = conf.read_text()
            assert f'server_name: "n{i}"' in text and "jetstream" in text
            routes = [f"nats://127.0.0.1:{p}" for p in c.cluster_ports]
            assert routes.pop(i) not in text.split("routes:")[1]
            assert all(r in text for r in routes)
    finally:
        for f in c.logs:
            f.close()


def test_private_postgres_says_why_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PrivatePostgres, "find", staticmethod(lambda name: None))
    pg = PrivatePostgres(tmp_path / "pg")
    assert pg.unavailable().startswith("no initdb, pg_ctl, postgres")
    assert pg.url.startswith("postgresql+asyncpg://postgres@127.0.0.1:")
    assert pg.url.endswith("/strait") and pg.env == {"DATABASE_URL": pg.url}


def test_disagg_config_is_one_disaggregated_engine_pool() -> None:
    import tomllib

    from bench.chaos import disagg
    from bench.chaos.campaign import RUNNERS, SCENARIOS
    from bench.chaos.fleet import TINY_MODEL, disagg_config_toml

    cfg = tomllib.loads(disagg_config_toml(prefill_workers=2))
    (pool,) = cfg["pools"]
    assert (pool["model"], pool["mode"], pool["backend"]) == (TINY_MODEL, "disaggregated", "engine")
    assert (pool["workers"], pool["prefill_workers"]) == (2, 2)
    assert cfg["engine"]["max_model_len"] == 256 and cfg["cache"]["enabled"] is True
    assert all(n in SCENARIOS and n in RUNNERS for n in disagg.RUNNERS)


def test_fixed_prompts_make_greedy_requests() -> None:
    load = Load.__new__(Load)
    load.opts, load.model, load.prompts = Opts(max_tokens=7), "tiny", []
    c = Call(3, "http", seed=3)
    assert "temperature" not in json.loads(load.body(c))  # the FAKE scenarios: as before
    load.prompts = ["p0", "p1"]
    c = Call(3, "http", seed=3, fixed_prompt="p1")
    body = json.loads(load.body(c))
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("tiny", 0.0, 7)
    assert body["messages"][0]["content"] == "p1"
    assert Call(3, "http", seed=3).prompt == "Write a haiku about the number 3."


async def test_the_link_proxy_forwards_cuts_and_restores() -> None:
    """bench.chaos.regions.LinkProxy (the region-link scenario's gateway link)."""
    import asyncio

    from bench.chaos.regions import LinkProxy
    from bench.support.services import free_port

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(100):
            w.write(data)
            await w.drain()
        w.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    listen = free_port()
    proxy = LinkProxy({listen: target.sockets[0].getsockname()[1]})
    proxy.start()
    try:

        async def read(r: asyncio.StreamReader) -> bytes:
            try:
                return await asyncio.wait_for(r.read(100), 5)
            except ConnectionResetError:  # the proxy aborts: a reset, or an end
                return b""

        async def roundtrip() -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", listen)
            try:
                w.write(b"ping")
                await w.drain()
            except ConnectionResetError:
                return b""
            data = await read(r)
            w.close()
            return data

        assert await roundtrip() == b"ping"
        r, w = await asyncio.open_connection("127.0.0.1", listen)
        proxy.cut()
        assert await read(r) == b""  # the open connection is dropped
        assert await roundtrip() == b""  # and a new one gets nothing through
        proxy.restore()
        await asyncio.sleep(0.1)
        assert await roundtrip() == b"ping"
        w.close()
    finally:
        proxy.stop()
        target.close()
