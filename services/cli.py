"""``strait``: the one entry point.

strait up                    the whole fleet on this machine (foreground)
strait gateway|router|worker|cache|batch
                             one service (for compose and Kubernetes); a worker's role is
                             worker.role or --role (aggregated, prefill, decode)
strait prefill|decode        strait worker --role prefill / strait worker
strait planner               size every pool ahead of its load (docs/planner.md)
strait batch                 the Batch API's runner as a process of its own (decision 0028)
strait up --secure           the same behind a secured nats-server (accounts per team, TLS)
strait keys create|list|revoke
strait teams add|list|revoke teams on NATS: credentials and the server's accounts
strait models prepare|convert|list
strait bench serve|engine|quality|structured
strait drain WORKER_ID       drain one worker over NATS (as SIGTERM does), then it exits
strait adapters load|unload|list [NAME] [--pool P] [--path DIR]
                             a pool's LoRA adapters at run time (services/adapters.py)
strait schemas               write the wire protocol's JSON schemas to docs/schemas/

``strait bench NAME`` imports ``bench.NAME`` only when it runs (``BENCHES``): the product
commands never load the benchmarks, whose dependencies are an extra (``strait[bench]``), and the
dependency points from ``bench/`` to ``libs``/``services``, never back. The bench modules stay
runnable on their own (``python -m bench.NAME``); this subcommand is a shortcut to four of them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path

import msgspec

from libs.engine.params import PRIORITY_BANDS
from libs.settings import Settings, get_settings

SERVICES = ("gateway", "router", "worker", "prefill", "decode", "cache", "planner", "batch")
WORKER_ROLES = ("aggregated", "prefill", "decode")
# `strait bench NAME`: the module whose `main(argv) -> int` it runs, imported then (see above).
BENCHES = {
    "serve": "bench.serve",
    "engine": "bench.engine",
    "quality": "bench.quality",
    "structured": "bench.structured",
}
# Seconds `strait teams` waits to tell the running fleet of a change.
ANNOUNCE_TIMEOUT_S = 5.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strait", description="Strait: LLM serving over NATS.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run the whole fleet in the foreground")
    up.add_argument(
        "--secure",
        action="store_true",
        help="start a nats-server of the fleet's own with an account per team (strait teams) "
        "and TLS from a development CA under <state_dir>/secure (docs/security.md)",
    )
    for name in SERVICES:
        service = sub.add_parser(name, help=f"run the {name} service")
        if name == "worker":
            service.add_argument(
                "--role", choices=WORKER_ROLES, default=None, help="instead of worker.role"
            )

    _account_parsers(sub)
    models = sub.add_parser("models", help="prepare local models").add_subparsers(
        dest="action", required=True
    )
    mp = models.add_parser(
        "prepare", help="install (if missing) and convert known models once into the models dir"
    )
    mp.add_argument("names", nargs="*", help="model names (default: every engine pool's model)")
    mc = models.add_parser("convert", help="convert a GGUF file to a safetensors directory")
    mc.add_argument("gguf")
    mc.add_argument("out")
    models.add_parser("list", help="list known and prepared models")
    mf = models.add_parser(
        "formats", help="bytes of linear weights a step reads in each engine.quantization"
    )
    mf.add_argument("name", nargs="?", default=None, help="model (default: the first pool's)")

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("which", choices=list(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER)

    dr = sub.add_parser(
        "drain",
        help="drain a worker over NATS (as SIGTERM does): no new work, running requests "
        "finish or migrate, then it exits (`strait up` starts it again)",
    )
    dr.add_argument("worker_id")
    dr.add_argument("--reason", default="operator")

    ad = sub.add_parser("adapters", help="load, unload or list a pool's LoRA adapters")
    ad.add_argument("action", choices=["load", "unload", "list"])
    ad.add_argument("name", nargs="?", default="")
    ad.add_argument("--pool", default="", help="the pool (default: the first)")
    ad.add_argument("--path", default="", help="load: the adapter's directory on the workers")

    sc = sub.add_parser("schemas", help="write JSON schemas of the wire protocol")
    sc.add_argument("--out", default="docs/schemas")
    return p


def _account_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``strait keys`` and ``strait teams``: who may send, with what limits and terms."""
    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(
        dest="action", required=True
    )
    kc = keys.add_parser("create", help="create a key and print it once")
    kc.add_argument("name")
    _limit_arguments(kc, "gateway")
    kc.add_argument("--team", default=None, help="the team (strait teams) the key bills as")
    keys.add_parser("list", help="list keys (never their secrets)")
    kr = keys.add_parser("revoke", help="revoke a key by id")
    kr.add_argument("key_id")

    teams = sub.add_parser(
        "teams", help="teams on NATS: accounts, credentials, limits (docs/security.md)"
    ).add_subparsers(dest="action", required=True)
    ta = teams.add_parser("add", help="add a team: writes its nkey seed and the server config")
    ta.add_argument("name")
    _limit_arguments(ta, "teams")
    teams.add_parser("list", help="list teams (never their seeds)")
    tc = teams.add_parser(
        "config",
        help="print the nats-server config for the teams file (to load into servers that "
        "`strait up --secure` did not start: stage new teams first, docs/security.md)",
    )
    tc.add_argument(
        "--staged", nargs="*", default=[], metavar="NAME", help="these teams' accounts, no user"
    )
    tr = teams.add_parser(
        "revoke", help="revoke a team: its connections close and its requests are cancelled"
    )
    tr.add_argument("name")


def _limit_arguments(p: argparse.ArgumentParser, section: str) -> None:
    """--rpm / --tpm, defaulting to ``<section>.default_rpm`` / ``default_tpm``; and the flow
    control terms (docs/flow-control.md): --weight, --max-waiting, --priority."""
    for flag, what in (("rpm", "requests"), ("tpm", "tokens")):
        p.add_argument(
            f"--{flag}",
            type=int,
            default=None,
            help=f"{what} per minute (default: {section}.default_{flag})",
        )
    p.add_argument(
        "--weight", type=float, default=None, help="weight in the fair share of tokens (default 1)"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="most requests waiting for a pool before over_share / 429 (default: flow.max_waiting)",
    )
    p.add_argument(
        "--priority",
        choices=PRIORITY_BANDS,
        default=None,
        help="the best band its requests may use (default: interactive, any)",
    )


def _keys(args: argparse.Namespace) -> int:
    from libs.db import keys as keydb

    settings = get_settings()
    if args.action == "create":
        key_id, secret = asyncio.run(
            keydb.create_key(
                settings,
                args.name,
                args.rpm,
                args.tpm,
                team=args.team,
                terms=keydb.FlowTerms(args.weight, args.max_waiting, args.priority),
            )
        )
        print(f"id:     {key_id}\nsecret: {secret}\n(the secret is shown only now)")
    elif args.action == "list":
        for row in asyncio.run(keydb.list_keys(settings)):
            print(json.dumps(row, default=str))
    elif args.action == "revoke":
        ok = asyncio.run(keydb.revoke_key(settings, args.key_id))
        print("revoked" if ok else f"no such key: {args.key_id}")
        return 0 if ok else 1
    return 0


def _teams(settings: Settings, args: argparse.Namespace) -> int:
    from libs.security.fleet import SecureFleet
    from libs.security.teams import TeamError
    from services.supervisor.nats_server import nats_server_binary

    sf = SecureFleet(settings)
    try:
        if args.action == "list":
            for t in sf.store.load().teams:
                print(json.dumps(msgspec.to_builtins(t)))
            return 0
        if args.action == "config":
            print(sf.config_text(frozenset(args.staged)), end="")
            return 0
        if args.action == "add":
            team = sf.store.add(
                args.name,
                args.rpm,
                args.tpm,
                args.weight or 1.0,
                args.max_waiting,
                args.priority or "interactive",
            )
            revoked: list[str] = []
        else:
            team = sf.store.revoke(args.name)
            revoked = [team.name]
    except TeamError as e:
        print(str(e), file=sys.stderr)
        return 1
    if args.action == "add" and sf.pid_file.exists():
        # Its requests stream first, so that its first request lands once it can log in.
        try:
            asyncio.run(asyncio.wait_for(sf.ensure_streams([team.name]), ANNOUNCE_TIMEOUT_S))
        except Exception as e:  # the routers add it within router.sweep_interval_s
            print(f"could not add the team's requests stream at once ({e!r}); routers will")
    try:
        reloaded = sf.apply(nats_server_binary())
    except RuntimeError as e:
        print(f"the running server did not confirm the change: {e}", file=sys.stderr)
        return 1
    if reloaded:
        try:
            asyncio.run(asyncio.wait_for(sf.announce(revoked), ANNOUNCE_TIMEOUT_S))
        except Exception as e:  # the file and the server have it: routers read it within seconds
            print(f"could not tell the fleet at once ({e!r}); it reads the teams file soon")
    where = "the running server reloaded it" if reloaded else "no secured server runs now"
    if args.action == "add":
        print(
            f"team {team.name}: nkey {team.public_key}\n"
            f"  credentials: {sf.store.seed_file(team.name)}  (hand this file to the team)\n"
            f"  connect: NATS_URL=tls://{sf.host}:{sf.port} NATS_NKEY=<that file> "
            f"NATS_CA={sf.tls.ca}\n"
            f"  server config {sf.conf} ({where})"
        )
    else:
        print(f"team {team.name} revoked ({where}; its requests are cancelled)")
    return 0


def _models(args: argparse.Namespace) -> int:
    from libs import models

    settings = get_settings()
    if args.action == "prepare":
        names = args.names or sorted({p.model for p in settings.pools if p.backend == "engine"})
        for name in names:
            print(f"{name}: {models.prepare_model(name, settings)}")
    elif args.action == "convert":
        print(models.cli_convert(args.gguf, args.out))
    elif args.action == "list":
        for line in models.cli_list():
            print(line)
    elif args.action == "formats":
        from libs.models.formats import cli_formats

        name = args.name or settings.pools[0].model
        for line in cli_formats(models.prepare_model(name, settings)):
            print(line)
    return 0


def _schemas(out: str) -> int:
    from libs.protocol import json_schemas

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (path / f"{name}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(json_schemas())} schemas to {path}")
    return 0


def _worker(settings: Settings, role: str | None) -> int:
    """``strait worker [--role ROLE]`` (``role`` overrides ``worker.role``): the entry of the
    role's package; ``strait decode`` is ``strait worker``, ``strait prefill`` is
    ``strait worker --role prefill``."""
    if role is not None:
        settings = settings.model_copy(deep=True)
        settings.worker.role = role  # type: ignore[assignment]
    if settings.worker.role == "prefill":
        from services.prefill.main import main as prefill_main

        return prefill_main(settings)
    if settings.worker.role == "decode":
        from services.decode.main import main as decode_main

        return decode_main(settings)
    from services.worker.main import main as worker_main

    return worker_main(settings)


def _drain(settings: Settings, worker_id: str, reason: str) -> int:
    """Publish a DrainRequest to one worker and wait for its acknowledgement."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from libs.protocol import DrainRequest, Subjects, encode
    from libs.wire.nats_util import connect

    async def run() -> int:
        nc = await connect(settings.nats, "strait-drain")
        try:
            msg = DrainRequest(worker_id=worker_id, reason=reason)
            subject = Subjects.of(settings.nats).drain(worker_id)
            await nc.request(subject, encode(msg), timeout=settings.router.assign_timeout_s)
        except (NoRespondersError, NatsTimeout):
            print(f"no worker {worker_id!r} answered", file=sys.stderr)
            return 1
        finally:
            await nc.close()
        print(f"{worker_id}: draining (worker.drain_timeout_s = {settings.worker.drain_timeout_s})")
        return 0

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = get_settings()
    if args.cmd == "up":
        from services.supervisor.main import up

        return up(settings, secure=args.secure)
    if args.cmd == "gateway":
        from services.gateway.main import main as gateway_main

        return gateway_main(settings)
    if args.cmd == "router":
        from services.router.main import main as router_main

        return router_main(settings)
    if args.cmd in ("worker", "decode", "prefill"):
        role = "prefill" if args.cmd == "prefill" else getattr(args, "role", None)
        return _worker(settings, role)
    if args.cmd == "batch":
        from services.gateway.batch_main import main as batch_main

        return batch_main(settings)
    if args.cmd == "cache":
        from services.cache.main import main as cache_main

        return cache_main(settings)
    if args.cmd == "planner":
        from services.planner.main import main as planner_main

        return planner_main(settings)
    if args.cmd == "keys":
        return _keys(args)
    if args.cmd == "teams":
        return _teams(settings, args)
    if args.cmd == "drain":
        return _drain(settings, args.worker_id, args.reason)
    if args.cmd == "adapters":
        from services.adapters import run_cli

        return run_cli(settings, args.action, args.name, args.pool, args.path)
    if args.cmd == "models":
        return _models(args)
    if args.cmd == "bench":
        return int(importlib.import_module(BENCHES[args.which]).main(args.args))
    if args.cmd == "schemas":
        return _schemas(args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
