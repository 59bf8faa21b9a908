"""``/admin/pools/{pool}/adapters``: list, load and unload a pool's LoRA adapters at run time
(admin keys only, ``gateway.admin_keys``). Each call is one ``AdapterCommand`` to every worker
of the pool through ``services.adapters.send``, what ``strait adapters`` sends; the answer lists
every worker's reply. A refusal is OpenAI-shaped: 400 for an adapter that does not fit (the
worker's message names what), 404 for an unknown pool or adapter, 503 when no worker answered.

An adapter loads by name from the pool's ``adapters_dir`` only: ``strait adapters load
--path`` (an operator on the fleet's NATS account) is the way to load from elsewhere.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from libs.protocol import ERROR_HTTP_STATUS, AdapterCommand, AdapterReply
from libs.settings import Settings
from services.adapters import send
from services.gateway.deps import FleetDep, SettingsDep, admin_key
from services.gateway.errors import ApiError
from services.gateway.fleet import Fleet

router = APIRouter(dependencies=[Depends(admin_key)])


class AdapterLoad(BaseModel):
    """``POST /admin/pools/{pool}/adapters``'s body."""

    model_config = ConfigDict(extra="forbid")
    name: str  # the adapter: <pool.adapters_dir>/<name>/


def refusal(action: str, replies: list[AdapterReply]) -> ApiError | None:
    """Why the command failed, or None: a load must succeed on every worker that answered, an
    unload on one (the others did not hold it), a list always does."""
    failed = [r for r in replies if not r.ok]
    if action == "list" or not failed or (action == "unload" and len(failed) < len(replies)):
        return None
    first = failed[0]
    status = ERROR_HTTP_STATUS.get(first.code, 500)
    return ApiError(status, f"worker {first.worker_id}: {first.error}", first.code or None, "name")


async def command(
    settings: Settings, fleet: Fleet, pool: str, action: str, name: str = ""
) -> dict[str, Any]:
    """Send one ``AdapterCommand`` to ``pool``'s workers; the answer, or an ``ApiError``."""
    if pool not in {p.name for p in settings.pools}:
        raise ApiError(404, f"no pool {pool!r} in this fleet", "model_not_found", "pool")
    if fleet.nc is None:
        raise ApiError(503, "the gateway is not connected to NATS", "no_worker")
    fleet.registry.expire()
    live = sum(1 for v in fleet.registry.workers.values() if v.beat.pool == pool)
    cmd = AdapterCommand(action=action, name=name)  # type: ignore[arg-type]
    wait_s = settings.router.assign_timeout_s
    replies = await send(fleet.nc, fleet.subjects, pool, cmd, wait_s, expect=live)
    if not replies:
        raise ApiError(503, f"no worker of pool {pool!r} answered within {wait_s:g} s", "no_worker")
    error = refusal(action, replies)
    if error is not None:
        raise error
    workers = [
        {"worker_id": r.worker_id, "ok": r.ok, "error": r.error, "loaded": r.loaded}
        for r in replies
    ]
    return {
        "object": "strait.adapters",
        "pool": pool,
        "action": action,
        "adapter": name,
        "workers": workers,
    }


@router.get("/admin/pools/{pool}/adapters")
async def list_adapters(pool: str, settings: SettingsDep, fleet: FleetDep) -> dict[str, Any]:
    """What each worker of ``pool`` holds."""
    return await command(settings, fleet, pool, "list")


@router.post("/admin/pools/{pool}/adapters")
async def load_adapter(
    pool: str, body: AdapterLoad, settings: SettingsDep, fleet: FleetDep
) -> dict[str, Any]:
    """Every worker of ``pool`` reads ``body.name`` from the pool's directory into a slot."""
    return await command(settings, fleet, pool, "load", body.name)


@router.delete("/admin/pools/{pool}/adapters/{name}")
async def unload_adapter(
    pool: str, name: str, settings: SettingsDep, fleet: FleetDep
) -> dict[str, Any]:
    """Every worker of ``pool`` forgets ``name``; requests running on it finish first."""
    return await command(settings, fleet, pool, "unload", name)
