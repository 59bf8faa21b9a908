"""``strait gateway``: the HTTP front door under uvicorn (one process; scale with replicas)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from libs.log import setup_logging
from libs.runtime import run_loop
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
    try:
        run_loop(uvicorn.Server(config).serve(), settings)
    finally:
        shutdown_tracing()
    return 0
