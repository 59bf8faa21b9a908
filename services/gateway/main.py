"""``strait gateway``: the HTTP front door under uvicorn (one process; scale with replicas)."""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI

from libs.log import setup_logging
from libs.runtime import run_loop, watch_parent
from libs.settings import Settings, get_settings
from libs.telemetry import setup_tracing, shutdown_tracing
from services.gateway.app import create_app


def build_app(settings: Settings) -> FastAPI:
    """The app with the configured key store (database-backed when auth is on)."""
    return create_app(settings)


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    setup_logging("gateway", settings.telemetry.log_level, settings.telemetry.log_json)
    setup_tracing("gateway", settings.telemetry.service_namespace)
    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        lifespan="on",
        http=settings.gateway.http_parser,
    )
    server = uvicorn.Server(config)

    async def serve() -> None:
        def stop() -> None:
            server.should_exit = True  # uvicorn's own graceful shutdown, as on SIGTERM

        watch = asyncio.create_task(watch_parent(stop, lambda: server.should_exit))
        try:
            await server.serve()
        finally:
            watch.cancel()

    try:
        run_loop(serve(), settings)
    finally:
        shutdown_tracing()
    return 0
