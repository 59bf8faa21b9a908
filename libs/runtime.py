"""Service runtime: one entry function per service process.

``run_service(name, body, settings)`` sets up logging and tracing, turns SIGTERM/SIGINT into a
stop event, optionally serves ``/health``, ``/ready`` and ``/metrics`` on a small HTTP listener,
and runs ``body(ctx)`` until it returns. ``body`` is expected to wait on ``ctx.stopping`` and
then drain: finish or hand back in-flight work, close NATS, return. A parent-death watch ends the
process when the supervisor (``strait up``) that started it is gone.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from libs.log import fields, setup_logging
from libs.settings import Settings
from libs.telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger("strait.runtime")
T = TypeVar("T")

# Seconds between checks that the supervisor which started us is still alive.
PARENT_WATCH_INTERVAL_S = 1.0


@dataclass
class ServiceContext:
    name: str
    settings: Settings
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # Replaced by the body once it can take work (answers /ready); not ready while loading.
    ready: Callable[[], bool] = lambda: False

    def serving(self, ready: Callable[[], bool]) -> None:
        """Called by the body once its start-up is done: ``/ready`` answers ``ready()`` from
        now on, and the start-up heap is settled (``settle_heap``)."""
        self.ready = ready
        settle_heap(self.settings)


async def _serve_http(ctx: ServiceContext, host: str, port: int) -> asyncio.Server:
    """Minimal HTTP/1.0 responder: GET /health, /ready, /metrics. Nothing else."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5)
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b""):
                pass
            status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            if path == "/health":
                status, body = "200 OK", b"ok\n"
            elif path == "/ready":
                ok = ctx.ready() and not ctx.stopping.is_set()
                status, body = (
                    ("200 OK", b"ready\n") if ok else ("503 Service Unavailable", b"not ready\n")
                )
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest()
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def watch_parent(stop: Callable[[], None], stopped: Callable[[], bool]) -> None:
    """Call ``stop`` once the process that started this one (``STRAIT_PARENT_PID``, set by
    `strait up`) is gone, even killed with SIGKILL: a child must not outlive its supervisor
    holding a port or a worker id. Every service runs it (``run_service``; the gateway
    beside uvicorn); nothing to watch without the variable."""
    parent = os.environ.get("STRAIT_PARENT_PID")
    if not parent:
        return
    pid = int(parent)
    while not stopped():
        await asyncio.sleep(PARENT_WATCH_INTERVAL_S)
        if os.getppid() != pid:
            log.warning("supervisor gone; stopping", extra=fields(parent_pid=pid))
            stop()
            return


async def _watch_parent(ctx: ServiceContext) -> None:
    await watch_parent(ctx.stopping.set, ctx.stopping.is_set)


def run_loop(main: Coroutine[Any, Any, T], settings: Settings) -> T:
    """Run a service process's main coroutine to its end on ``settings.event_loop``
    (``run_service`` and the gateway's entry call it, once per process)."""
    if settings.runtime.event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def settle_heap(settings: Settings) -> None:
    """Called once by each service when its start-up is done, before it takes work, inside
    its event loop: with ``runtime.gc_freeze``, collect, then freeze what is alive
    (``gc.freeze``), and keep freezing and sweeping on the loop (:class:`HeapKeeper`)."""
    r = settings.runtime
    if not r.gc_freeze:
        return
    gc.collect()
    gc.freeze()
    log.debug("heap frozen", extra=fields(objects=gc.get_freeze_count()))
    HeapKeeper(r.gc_freeze_interval_s, r.gc_sweep_interval_s).start()


class HeapKeeper:
    """Keeps the cyclic collector's pauses short in a process holding many long-lived objects.

    A gateway streaming to a thousand clients holds ~220 container objects per stream
    (coroutines of the ASGI stack, closures, deques, futures) for the seconds a stream lasts;
    each full collection scanned all of them (~220k objects, 160–200 ms on the reference VM)
    every ~4 s and found nothing, and each second-generation one scanned the last ~0.4 s of
    requests (~10 ms). Every ``freeze_interval_s`` the survivors are frozen (``gc.freeze``:
    a constant-time list splice), so collections scan at most that long's allocations. Frozen
    objects are still freed by reference counting; only a cycle that forms among them is not,
    so every ``sweep_interval_s`` they are thawed and fully collected once (one pause of a
    full collection, logged with what it freed). 0 turns either off.
    """

    def __init__(self, freeze_interval_s: float, sweep_interval_s: float) -> None:
        self.freeze_interval_s = freeze_interval_s
        self.sweep_interval_s = sweep_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.freeze_interval_s > 0:
            self._loop.call_later(self.freeze_interval_s, self._freeze)
        if self.sweep_interval_s > 0:
            self._loop.call_later(self.sweep_interval_s, self._sweep)

    def _freeze(self) -> None:
        assert self._loop is not None
        gc.freeze()
        self._loop.call_later(self.freeze_interval_s, self._freeze)

    def _sweep(self) -> None:
        assert self._loop is not None
        self.sweep()
        self._loop.call_later(self.sweep_interval_s, self._sweep)

    @staticmethod
    def sweep() -> int:
        """Thaw, collect everything, freeze again; returns the objects collected."""
        t0 = time.perf_counter()
        gc.unfreeze()
        collected = gc.collect()
        gc.freeze()
        log.info(
            "heap swept",
            extra=fields(
                collected=collected,
                frozen=gc.get_freeze_count(),
                pause_ms=round((time.perf_counter() - t0) * 1000, 1),
            ),
        )
        return collected


def run_service(
    name: str,
    body: Callable[[ServiceContext], Awaitable[None]],
    settings: Settings,
    http_port: int = 0,
) -> int:
    """Run one service in this process until SIGTERM/SIGINT; returns the exit code."""
    setup_logging(name, settings.telemetry.log_level, settings.telemetry.log_json)
    setup_tracing(name, settings.telemetry.service_namespace)

    async def main() -> int:
        ctx = ServiceContext(name=name, settings=settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, ctx.stopping.set)
        server = (
            await _serve_http(ctx, settings.telemetry.http_host, http_port) if http_port else None
        )
        watch = asyncio.create_task(_watch_parent(ctx))
        log.info(
            "service starting", extra=fields(service=name, pid=os.getpid(), http_port=http_port)
        )
        try:
            await body(ctx)
            return 0
        except Exception:
            log.exception("service failed", extra=fields(service=name))
            return 1
        finally:
            watch.cancel()
            if server is not None:
                server.close()
            log.info("service stopped", extra=fields(service=name))

    try:
        return run_loop(main(), settings)
    finally:
        shutdown_tracing()
