"""One scenario's run and its row: start the fleet and the load, inject the fault, stop the load,
then count what the clients, the ledger, the workers and the routers' consumer saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from itertools import pairwise
from typing import Any

from bench.chaos.fleet import DISAGG_ENGINE, ROUTE_RETRY, Fleet, Opts, Rows
from bench.chaos.load import Load, fetch_references, reference
from bench.stats import nearest_rank
from libs.wire.nats_util import server_urls

STALL_S = 0.5  # a stream silent longer than this after the fault counts as stalled by it

# A scenario: its options in, its row out.
Runner = Callable[[Opts], Awaitable[dict[str, Any]]]


async def router_consumer(
    url: str, stream: str = "STRAIT_REQUESTS", durable: str = "router"
) -> dict[str, Any]:
    """The routers' requests consumer: messages never acked (a poison message stays there);
    any other durable consumer with ``stream`` and ``durable`` (the ledger's)."""
    from nats.aio.client import Client as NATS

    nc = NATS()
    try:
        await nc.connect(
            servers=server_urls(url),
            name="chaos-measure",
            max_reconnect_attempts=1,
            connect_timeout=2,
        )
        info = await nc.jetstream().consumer_info(stream, durable)
        return {
            "ack_pending": info.num_ack_pending or 0,
            "redelivered": info.num_redelivered or 0,
            "pending": info.num_pending or 0,
        }
    except Exception as e:
        return {"error": repr(e)[:100]}
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def measure(
    name: str,
    fleet: Fleet,
    load: Load,
    t_fault: float | None,
    references: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``references``: the text of each fixed prompt run uninterrupted (the real engine's
    scenarios); without, the FAKE engine's own answer for the prompt and seed."""
    opts, calls = load.opts, load.calls
    m = opts.max_tokens
    ok = [c for c in calls if c.status == "ok"]
    if references is None:
        done = [c for c in ok if c.usage == m and len(c.texts) == m]
    else:  # a real tokenizer's token may stream no text of its own (a split character)
        done = [c for c in ok if c.usage == m]
    bad = []
    for c in calls:
        if references is None:
            ref = await reference(c.prompt, c.seed, m)
        else:
            ref = references[c.prompt]
        got = "".join(c.texts)
        if not ref.startswith(got) or (c.status == "ok" and (got != ref or c.usage != m)):
            bad.append(c)
    # Migrations: the gateways' request log lines, the client's own count on NATS.
    gw_lines = [r for r in fleet.log_lines("gateway") if r.get("msg") == "request"]
    moved = {r["request_id"]: r.get("migrations") or 0 for r in gw_lines}
    for c in calls:
        if c.path == "http":
            c.migrations = moved.get(c.request_id, 0)
    router_log = Counter(r.get("msg") for r in fleet.log_lines("router"))
    # A request of the load run to its end by two workers (a redelivered one placed again).
    ids = {c.request_id for c in calls}
    served = Counter(
        r["request_id"]
        for r in fleet.log_lines("worker")
        if r.get("msg") == "request" and r.get("status") == "ok" and r["request_id"] in ids
    )
    gw_metric = 0.0
    for url in fleet.gateway_urls:
        n = await asyncio.to_thread(fleet.scrape, url, "strait_gateway_migrations_total")
        gw_metric += n or 0.0
    # What the surviving workers still run, once the streams are over.
    await asyncio.sleep(2.0)
    held = {w: await fleet.running(w) for w in fleet.live_workers()}
    # KV blocks the surviving workers still hold for requests (the real engine's gauge; cached
    # blocks count as free). The FAKE engine reports its prefix-cache size there instead.
    blocks = {
        w: await asyncio.to_thread(
            fleet.scrape,
            f"http://127.0.0.1:{fleet.metrics_port[w]}",
            "strait_worker_kv_blocks_used",
        )
        for w in fleet.live_workers()
    }
    # Ledger: wait (a bounded while) for the rows of completed requests.
    deadline = time.monotonic() + 15
    while True:
        rows = await fleet.ledger.rows()
        lost = [c for c in done if rows.get(c.request_id, ("", 0))[0] != "ok"]
        if not lost or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    consumer = await router_consumer(fleet.nats.live_url)
    try:
        events = await usage_events(fleet.nats.live_url)
        vs_events = ledger_vs_events(rows, events, {c.request_id for c in calls})
    except Exception as e:
        vs_events = {"usage_events_error": repr(e)[:200]}
    wrong = [c for c in done if c.request_id in rows and rows[c.request_id][1] != c.usage]
    # Requests whose client saw a failure but the fleet finished them (a worker's own usage
    # event records the work done: a killed gateway's streams, for one).
    billed_failed = [
        c for c in calls if c.status != "ok" and rows.get(c.request_id, ("",))[0] == "ok"
    ]
    # The longest silence each stream open at the fault saw after it (to its next token, between
    # tokens, or to its end); the streams silent for more than STALL_S are the fault's.
    silence = []
    if t_fault is not None:
        for c in calls:
            if c.t_send < t_fault and (c.t_end is None or c.t_end > t_fault):
                marks = [t_fault, *(t for t in c.times if t > t_fault), c.t_end or t_fault]
                silence.append(max(b - a for a, b in pairwise(marks)))
    stall = [x for x in silence if x > STALL_S]
    # Time to first token of the requests sent after the fault (a lost router's or server's
    # queued requests show here).
    ttft = [c.times[0] - c.t_send for c in calls if t_fault and c.t_send > t_fault and c.times]
    failed = Counter(c.error for c in calls if c.status == "failed")
    return {
        "scenario": name,
        "engine": "FAKE",
        "streams": opts.streams,
        "requests": len(calls),
        "completed": len(done),
        "migrated": sum(1 for c in calls if c.migrations),
        "failed": sum(failed.values()),
        "failed_by": dict(failed),
        "hangs": sum(1 for c in calls if c.status == "hang"),
        "hang_ids": [c.request_id for c in calls if c.status == "hang"][:20],
        "failed_ids": [c.request_id for c in calls if c.status == "failed"][:20],
        "bad_text": len(bad),
        "bad_text_ids": [c.request_id for c in bad][:20],
        "bad_text_by_path": dict(Counter(c.path for c in bad)),
        "ledger_lost": len(lost),
        "ledger_lost_ids": [c.request_id for c in lost][:20],
        "ledger_wrong": len(wrong),
        "ledger_ok_rows_of_failed": len(billed_failed),
        "held_after": {w: v for w, v in held.items()},
        "kv_blocks_used_after": blocks,
        "held_after_total": sum(v or 0 for v in held.values()),
        "crashed": fleet.crashed(),
        "ended_by_fault": sorted(fleet.expected_dead),
        "open_at_fault": len(silence),
        "stalled": len(stall),
        "stall_s": [nearest_rank(stall, 0.5), max(stall) if stall else None],
        "silence_p50_s": nearest_rank(silence, 0.5),
        "ttft_after_s": [nearest_rank(ttft, 0.5), max(ttft) if ttft else None],
        "gateway_migrations_metric": gw_metric,
        "router_migrations_logged": router_log["migrating request of a lost worker"],
        "router_replaced_logged": router_log["re-placing request"],
        "router_redelivered_logged": router_log["request redelivered"],
        "served_twice": sum(1 for n in served.values() if n > 1),
        "router_consumer": consumer,
        "nats_server_errors": [
            line.split("] ", 2)[-1][:200]
            for path in fleet.nats.log_paths
            for line in path.read_text(errors="replace").splitlines()
            if "[ERR]" in line and ROUTE_RETRY not in line
        ][:10],
        # A cluster's servers dialling a peer not up yet (start-up) or gone (the fault).
        "nats_route_retries": sum(
            path.read_text(errors="replace").count(ROUTE_RETRY) for path in fleet.nats.log_paths
        ),
        "nats_reconnects_logged": dict(
            Counter(r["_proc"] for r in fleet.log_lines("") if r.get("msg") == "nats reconnected")
        ),
        "worker_resent_logged": sum(
            1 for r in fleet.log_lines("worker") if r.get("msg") == "resent"
        ),
        "by_path": {p: Counter(c.status for c in calls if c.path == p) for p in ("http", "nats")},
        **vs_events,
        "logs": str(fleet.tmp),
    }


async def run_scenario(
    name: str,
    opts: Opts,
    fault: Callable[[Fleet, Load], Coroutine[Any, Any, None]] | None,
    settle: float = 0.0,
    before_measure: Callable[[Fleet, Load], Coroutine[Any, Any, dict[str, Any]]] | None = None,
    prompts: list[str] | None = None,
    fleet_class: type[Fleet] | None = None,
    **fleet_kw: Any,
) -> dict[str, Any]:
    """One scenario on a fleet of its own; ``settle``: seconds to wait after the load before
    measuring (for what happens later, such as a redelivery); ``before_measure``: the
    scenario's own wait and figures, merged into its row; ``prompts``: greedy requests of
    these prompts only, each compared with its uninterrupted text (fetched first);
    ``fleet_class``: another shape of fleet (bench.chaos.regions's two regions)."""
    t0 = time.monotonic()
    print(f"[{name}] starting the fleet ...", file=sys.stderr, flush=True)
    with (fleet_class or Fleet)(opts.run_dir / name, opts, **fleet_kw) as fleet:
        load = Load(fleet, opts)
        refs = None
        if prompts:
            load.prompts = list(prompts)
            refs = await fetch_references(load, opts.bound)
            print(f"[{name}] {len(refs)} reference texts", file=sys.stderr, flush=True)
        print(f"[{name}] load: {opts.streams} streams", file=sys.stderr, flush=True)
        t_fault = await load.run((lambda: fault(fleet, load)) if fault else None)
        await asyncio.sleep(settle)
        extra = await before_measure(fleet, load) if before_measure else {}
        row = await measure(name, fleet, load, t_fault, refs) | extra
        if refs is not None:
            row["engine"] = DISAGG_ENGINE
            row["reference_texts"] = refs
    row["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"[{name}] done in {row['wall_s']} s: {short(row)}", file=sys.stderr, flush=True)
    return row


def short(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    return (
        f"{r['completed']}/{r['requests']} completed, {r['migrated']} migrated, "
        f"{r['failed']} failed, {r['hangs']} hangs, {r['bad_text']} bad text"
    )


def ledger_vs_events(rows: Rows, events: list[tuple[int, Any]], ids: set[str]) -> dict[str, Any]:
    """The ledger's rows against the usage events in JetStream (every request id with an event
    has one row, no row lacks one, tokens agree), and rows holding a worker's own event although
    the gateway's or client's, later (``finished_at``), is in the stream too (the row the
    ledger's docstring says the latter replaces)."""
    by_id: dict[str, list[tuple[int, Any]]] = {}
    for seq, ev in events:
        by_id.setdefault(ev.request_id, []).append((seq, ev))
    latest = {
        rid: max((e for _, e in evs), key=lambda e: e.finished_at) for rid, evs in by_id.items()
    }
    differ = [r for r, ev in latest.items() if r in rows and rows[r][1] != ev.completion_tokens]
    worker_won, worker_after = [], 0
    for rid, evs in by_id.items():
        if rid not in rows or rows[rid][2] != "worker":
            continue
        workers = [(seq, e) for seq, e in evs if e.source == "worker"]
        others = [(seq, e) for seq, e in evs if e.source != "worker"]
        if (
            workers
            and others
            and max(e.finished_at for _, e in others) >= max(e.finished_at for _, e in workers)
        ):
            worker_won.append(rid)
            worker_after += max(seq for seq, _ in workers) > max(seq for seq, _ in others)
    return {
        "ledger_rows": len(rows),
        "ledger_rows_of_load": len(ids & set(rows)),
        "ledger_rows_by_source": dict(Counter(r[2] for r in rows.values())),
        "usage_events": len(events),
        "usage_events_by_source": dict(Counter(e.source for _, e in events)),
        "usage_event_request_ids": len(by_id),
        "events_without_row": len(set(by_id) - set(rows)),
        "events_without_row_ids": sorted(set(by_id) - set(rows))[:20],
        "rows_without_event": len(set(rows) - set(by_id)),
        "rows_tokens_differ_from_latest_event": len(differ),
        "rows_worker_event_over_later_client_event": len(worker_won),
        "rows_worker_event_over_later_client_event_ids": worker_won[:20],
        "of_those_worker_event_later_in_stream": worker_after,
    }


async def usage_events(url: str) -> list[tuple[int, Any]]:
    """Every usage event in the events stream (the gateways', the clients' and the workers'
    own), read through an ephemeral consumer that acks nothing."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.js.errors import FetchTimeoutError

    from libs.protocol import ProtocolError, Subjects, UsageEvent, decode

    s = Subjects()
    wanted = {s.event("usage"), s.worker_usage}
    out: list[tuple[int, Any]] = []
    nc = await nats.connect(
        servers=server_urls(url), name="chaos-events", max_reconnect_attempts=1, connect_timeout=2
    )
    try:
        js = nc.jetstream()
        cfg = ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=60
        )
        sub = await js.pull_subscribe(s.events_all, stream="STRAIT_EVENTS", config=cfg)
        while True:
            try:
                msgs = await sub.fetch(1000, timeout=2)
            except (FetchTimeoutError, TimeoutError):
                break
            for m in msgs:
                if m.subject in wanted:
                    with contextlib.suppress(ProtocolError):
                        out.append((m.metadata.sequence.stream, decode(m.data, UsageEvent)))
            if (await sub.consumer_info()).num_pending == 0:
                break
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    finally:
        await nc.close()
    return out


def skipped(name: str, opts: Opts, why: str) -> dict[str, Any]:
    print(f"[{name}] skipped: {why}", file=sys.stderr, flush=True)
    return {"scenario": name, "engine": "FAKE", "streams": opts.streams, "skipped": why}
