"""FastAPI dependencies shared by the routes (``Annotated`` aliases)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from libs.settings import Settings
from services.gateway.auth import KeyInfo, KeyStore
from services.gateway.errors import ApiError
from services.gateway.fleet import Fleet


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_fleet(request: Request) -> Fleet:
    fleet: Fleet = request.app.state.fleet
    return fleet


def get_keys(request: Request) -> KeyStore:
    keys: KeyStore = request.app.state.keys
    return keys


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


SettingsDep = Annotated[Settings, Depends(get_settings)]
FleetDep = Annotated[Fleet, Depends(get_fleet)]
KeyDep = Annotated[KeyInfo, Depends(require_key)]
