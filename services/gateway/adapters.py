"""LoRA adapters as OpenAI model objects for ``/v1/models`` and ``/v1/models/{id}``: each
adapter a pool serves (libs/models/adapters.py) with its pool's base model as ``parent``, as vLLM
lists its LoRA modules. A name nobody serves stays OpenAI's 404 ``model_not_found``."""

from __future__ import annotations

from typing import Any

from libs.models.adapters import AdapterCatalogue
from libs.registry import WorkerRegistry
from libs.settings import Settings


def adapter_cards(
    settings: Settings, catalogue: AdapterCatalogue, registry: WorkerRegistry, now: int
) -> list[dict[str, Any]]:
    """One card per adapter; ``strait_loaded``: some worker of its pool has it loaded."""
    models = {p.name: p.model for p in settings.pools}
    loaded: set[tuple[str, str]] = set()
    for view in registry.workers.values():
        loaded.update((view.beat.pool, name) for name in view.beat.adapters)
    announced = ((pool, [name]) for pool, name in loaded)
    cards = []
    for name, pool in sorted(catalogue.all(announced).items()):
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "strait",
                "root": name,
                "parent": models.get(pool, registry.pool_model.get(pool, "")),
                "strait_pool": pool,
                "strait_loaded": (pool, name) in loaded,
            }
        )
    return cards
