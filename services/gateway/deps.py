"""FastAPI dependencies shared by the routes (``Annotated`` aliases): the settings, the fleet,
the caller's API key, and the per-process objects ``create_app`` keeps on ``app.state``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from libs.db.batches import BatchStore
from libs.db.responses import ResponseStore
from libs.settings import Settings
from services.gateway.admission import Admission
from services.gateway.auth import KeyInfo, KeyStore
from services.gateway.background import BackgroundRuns
from services.gateway.cache import ResponseCache
from services.gateway.errors import ApiError
from services.gateway.fleet import Fleet


def from_state(name: str) -> Callable[[Request], Any]:
    """A dependency that returns ``app.state.<name>`` (set by ``create_app`` and its
    lifespan); each getter below is one, typed by its annotation."""

    def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    get.__name__ = f"get_{name}"
    return get


get_settings: Callable[[Request], Settings] = from_state("settings")
get_fleet: Callable[[Request], Fleet] = from_state("fleet")
get_keys: Callable[[Request], KeyStore] = from_state("keys")
get_admission: Callable[[Request], Admission] = from_state("admission")
get_cache: Callable[[Request], ResponseCache] = from_state("cache")
get_background: Callable[[Request], BackgroundRuns] = from_state("background")
# The stored responses (None: gateway.store_responses off, or no database yet).
get_responses: Callable[[Request], ResponseStore | None] = from_state("responses")
# The files and batches (None without a database).
get_batches: Callable[[Request], BatchStore | None] = from_state("batches")


async def require_key(request: Request) -> KeyInfo:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    store = get_keys(request)
    if not request.app.state.settings.gateway.auth_enabled:
        info = await store.verify("")
        assert info is not None
        return info
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
        )
    info = await store.verify(token.strip())
    if info is None:
        raise ApiError(401, "invalid or revoked API key", "invalid_api_key")
    request.state.key = info
    return info


async def models_key(request: Request) -> None:
    """An API key for the model listing, unless ``gateway.open_models``."""
    if not get_settings(request).gateway.open_models:
        await require_key(request)


async def metrics_key(request: Request) -> None:
    """An API key for ``/metrics``, unless ``gateway.open_metrics``."""
    if not get_settings(request).gateway.open_metrics:
        await require_key(request)


async def admin_key(request: Request) -> KeyInfo:
    """An admin key (``gateway.admin_keys``) for ``/admin/...``; every caller with auth off."""
    info = await require_key(request)
    settings = get_settings(request)
    if settings.gateway.auth_enabled and info.key_id not in settings.gateway.admin_keys:
        raise ApiError(
            403,
            "this route needs an admin key (gateway.admin_keys); this key is not one",
            "permission_denied",
        )
    return info


SettingsDep = Annotated[Settings, Depends(get_settings)]
FleetDep = Annotated[Fleet, Depends(get_fleet)]
KeyDep = Annotated[KeyInfo, Depends(require_key)]
AdmissionDep = Annotated[Admission, Depends(get_admission)]
CacheDep = Annotated[ResponseCache, Depends(get_cache)]
BackgroundDep = Annotated[BackgroundRuns, Depends(get_background)]
ResponsesDep = Annotated[ResponseStore | None, Depends(get_responses)]
BatchesDep = Annotated[BatchStore | None, Depends(get_batches)]
