"""The scenarios that take a store away: the ledger's PostgreSQL (``postgres-outage``) and one
server of a three-server NATS cluster (``nats-cluster``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from bench.chaos.fleet import Fleet, Opts, PrivatePostgres
from bench.chaos.load import Load
from bench.chaos.measure import Runner, router_consumer, run_scenario, skipped
from bench.support.nats_servers import NatsCluster
from libs.wire.nats_util import server_urls

PG_DOWN_S = 30.0  # postgres-outage: seconds the ledger's database stays down


PG_CATCHUP_S = 60.0  # postgres-outage: bound on the wait for the ledger to catch up after


async def postgres_outage(opts: Opts) -> dict[str, Any]:
    """The ledger on a PostgreSQL of the scenario's own; ``pg_ctl stop -m fast`` at the fault,
    down PG_DOWN_S while the load goes on (new requests until ``after`` s past its return), then
    started again; measured once the ledger has caught up (its consumer drained, the row count
    steady; at most PG_CATCHUP_S). Skipped, with the reason, where no PostgreSQL can be run."""
    name = "postgres-outage"
    tmp = opts.run_dir / name
    tmp.mkdir(parents=True, exist_ok=True)
    pg = PrivatePostgres(tmp / "postgres", traverse=[opts.run_dir, tmp])
    why = pg.unavailable()
    if why:
        return skipped(name, opts, why)
    try:
        try:
            await asyncio.to_thread(pg.setup)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return skipped(name, opts, f"the private PostgreSQL did not start: {e}")
        print(f"[{name}] private PostgreSQL on 127.0.0.1:{pg.port}", file=sys.stderr, flush=True)

        async def fault(fleet: Fleet, load: Load) -> None:
            fleet.mark_fault()
            stopped = await asyncio.to_thread(pg.stop)
            print(f"[{name}] PostgreSQL stopped ({stopped})", file=sys.stderr, flush=True)
            assert fleet.t_fault is not None
            await asyncio.sleep(max(0.0, PG_DOWN_S - (time.perf_counter() - fleet.t_fault)))
            await asyncio.to_thread(pg.start)
            t_back = time.perf_counter()
            print(f"[{name}] PostgreSQL started again", file=sys.stderr, flush=True)
            # While the load goes on: when are the rows of every request completed before the
            # restart (its backlog) in the table?
            backlog = {c.request_id for c in load.calls if c.status == "ok"}
            deadline = time.monotonic() + PG_CATCHUP_S
            while time.monotonic() < deadline:
                missing = backlog - set(await pg.rows())
                if not missing:
                    pg.info["backlog_written_s_after_restart"] = round(
                        time.perf_counter() - t_back, 1
                    )
                    break
                await asyncio.sleep(0.5)
            pg.info["backlog_requests"] = len(backlog)

        async def catch_up(fleet: Fleet, load: Load) -> dict[str, Any]:
            return await ledger_catchup(fleet, pg, load)

        run_opts = replace(opts, after=PG_DOWN_S + opts.after)
        return await run_scenario(name, run_opts, fault, before_measure=catch_up, ledger=pg)
    finally:
        await asyncio.to_thread(pg.close)


async def ledger_catchup(fleet: Fleet, pg: PrivatePostgres, load: Load) -> dict[str, Any]:
    """Wait until the ledger consumer has nothing pending or unacked and the row count held
    still between two polls (at most PG_CATCHUP_S)."""
    t_back = max((t for what, t in pg.events if what == "start"), default=time.perf_counter())
    deadline = time.monotonic() + PG_CATCHUP_S
    last, polls, drained_by = -1, 0, None
    consumer: dict[str, Any] = {}
    while True:
        n = len(await pg.rows())
        consumer = await router_consumer(fleet.nats.live_url, "STRAIT_EVENTS", "ledger")
        drained = consumer.get("pending") == 0 and consumer.get("ack_pending") == 0
        polls += 1
        if drained and n == last:
            drained_by = time.perf_counter() - t_back
            break
        if time.monotonic() > deadline:
            break
        last = n
        await asyncio.sleep(1.0)
    failures = [r for r in fleet.log_lines("gateway") if str(r.get("msg")).startswith("ledger")]
    return pg.info | {
        "ledger_drained_by_s_after_restart": None if drained_by is None else round(drained_by, 1),
        "ledger_catchup_polls": polls,
        "ledger_consumer": consumer,
        "ledger_log": dict(Counter(r["msg"] for r in failures)),
        "new_requests_s": round(load.opts.fault_at + load.opts.after, 1),
    }


async def nats_cluster(opts: Opts) -> dict[str, Any]:
    """Three JetStream nats-servers in one cluster, Strait's streams with 3 replicas, every
    process given the three URLs; SIGKILL the server most fleet processes are connected to,
    and leave it down."""
    name = "nats-cluster"
    tmp = opts.run_dir / name
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = NatsCluster(tmp, n=3, replicas=3)
    env = {"STRAIT_NATS__STREAM_REPLICAS": "3", "STRAIT_NATS__URL": cluster.url}

    async def fault(fleet: Fleet, load: Load) -> None:
        conns = await asyncio.to_thread(cluster.connections)
        fleet_conns = [[n for n in c if not n.startswith("chaos")] for c in conns]
        victim = max(range(cluster.n), key=lambda i: (len(fleet_conns[i]), -i))
        cluster.info["connections_before"] = {f"n{i}": sorted(c) for i, c in enumerate(conns)}
        cluster.info["meta_leader_before"] = await asyncio.to_thread(cluster.meta_leader)
        cluster.info["stream_leaders_before"] = await stream_leaders(cluster.url)
        cluster.info["killed"] = f"n{victim}"
        fleet.mark_fault()
        cluster.kill(victim)
        print(
            f"[{name}] SIGKILL n{victim} (connections: {', '.join(conns[victim])})",
            file=sys.stderr,
            flush=True,
        )

    async def after(fleet: Fleet, load: Load) -> dict[str, Any]:
        conns = await asyncio.to_thread(cluster.connections)
        cluster.info["connections_after"] = {
            f"n{i}": sorted(c) for i, c in enumerate(conns) if i in cluster.alive()
        }
        cluster.info["meta_leader_after"] = await asyncio.to_thread(cluster.meta_leader)
        cluster.info["stream_leaders_after"] = await stream_leaders(cluster.live_url)
        return {"nats_cluster": cluster.info}

    return await run_scenario(name, opts, fault, before_measure=after, nats=cluster, env=env)


async def stream_leaders(url: str) -> dict[str, Any]:
    """Each Strait stream's leader and replicas (name, current) as the cluster reports them."""
    import nats

    out: dict[str, Any] = {}
    try:
        nc = await nats.connect(
            servers=server_urls(url), name="chaos-info", max_reconnect_attempts=1, connect_timeout=2
        )
    except Exception as e:
        return {"error": repr(e)[:100]}
    try:
        js = nc.jetstream(timeout=5)
        for stream in ("STRAIT_REQUESTS", "STRAIT_EVENTS"):
            try:
                info = await js.stream_info(stream)
                cl = info.cluster
                out[stream] = {
                    "replicas_config": info.config.num_replicas,
                    "leader": cl.leader if cl else None,
                    "replicas": [(p.name, p.current) for p in (cl.replicas or [])] if cl else [],
                }
            except Exception as e:
                out[stream] = {"error": repr(e)[:100]}
    finally:
        await nc.close()
    return out


RUNNERS: dict[str, Runner] = {
    "postgres-outage": postgres_outage,
    "nats-cluster": nats_cluster,
}
