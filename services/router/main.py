"""``strait router``: the process around ``RouterService`` (``service.py``): settings, logging,
signals and the metrics port (``libs.runtime.run_service``), then start, run, close."""

from __future__ import annotations

from collections.abc import Callable

from libs.runtime import ServiceContext, run_service
from libs.settings import Settings, get_settings
from services.router.router import Router
from services.router.service import RouterService


async def serve(ctx: ServiceContext, on_router: Callable[[Router], None] | None = None) -> None:
    """The router service body; ``on_router`` (tests) receives the Router once it is built."""
    service = await RouterService.start(ctx, on_router)
    try:
        await service.run()
    finally:
        await service.close()


def main(settings: Settings | None = None) -> int:
    settings = settings or get_settings()
    return run_service("router", serve, settings, http_port=settings.router.metrics_port)
