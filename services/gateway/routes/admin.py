"""``/health`` (the process answers), ``/ready`` (NATS connected and a live worker) and
``/metrics`` (Prometheus; behind an API key unless ``gateway.open_metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.deps import FleetDep, metrics_key

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(fleet: FleetDep) -> JSONResponse:
    workers = fleet.live_workers()
    ok = fleet.connected and workers > 0
    body = {
        "status": "ready" if ok else "not ready",
        "nats": fleet.connected,
        "live_workers": workers,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", dependencies=[Depends(metrics_key)])
async def prom() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
