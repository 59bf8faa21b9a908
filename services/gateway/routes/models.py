"""``/v1/models`` and ``/v1/models/{id}``: every pool by its name and by its model, its LoRA
adapters (with their base as ``parent``), plus ``auto``, as OpenAI's model objects (behind an
API key unless ``gateway.open_models``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from libs.models.adapters import AdapterCatalogue
from libs.settings import Settings, model_identity
from services.gateway.adapters import adapter_cards
from services.gateway.deps import FleetDep, SettingsDep, models_key
from services.gateway.errors import ApiError
from services.gateway.fleet import Fleet

router = APIRouter(dependencies=[Depends(models_key)])


def catalogue(request: Request, settings: Settings) -> AdapterCatalogue:
    """The app's catalogue of adapters on disk (made on first use; it caches its listing)."""
    state = request.app.state
    if getattr(state, "adapters", None) is None:
        state.adapters = AdapterCatalogue(settings)
    return state.adapters  # type: ignore[no-any-return]


def model_cards(
    settings: Settings, fleet: Fleet, adapters: AdapterCatalogue
) -> list[dict[str, Any]]:
    """Every pool name and pool model, plus ``auto``, as OpenAI's model objects."""
    fleet.registry.expire()
    live = fleet.registry.pools()
    data = []
    now = int(time.time())
    for p in settings.pools:
        engine = settings.engine_for(p)
        for model_id in (p.name, p.model):
            data.append(
                {
                    "id": model_id,
                    "object": "model",
                    "created": now,
                    "owned_by": "strait",
                    "root": p.model,
                    "strait_pool": p.name,
                    # What the pool's workers hash KV under: name + weights' format.
                    "strait_model_id": model_identity(p.model, engine),
                    "strait_quantization": engine.quantization,
                    "strait_live": p.name in live,
                }
            )
    data += adapter_cards(settings, adapters, fleet.registry, now)
    data.append(
        {"id": "auto", "object": "model", "created": now, "owned_by": "strait", "root": "auto"}
    )
    return data


@router.get("/v1/models")
async def models(request: Request, settings: SettingsDep, fleet: FleetDep) -> dict[str, Any]:
    cards = model_cards(settings, fleet, catalogue(request, settings))
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def model(
    model_id: str, request: Request, settings: SettingsDep, fleet: FleetDep
) -> dict[str, Any]:
    for card in model_cards(settings, fleet, catalogue(request, settings)):
        if card["id"] == model_id:
            return card
    raise ApiError(
        404,
        f"The model '{model_id}' does not exist or you do not have access to it.",
        "model_not_found",
        "model",
    )
