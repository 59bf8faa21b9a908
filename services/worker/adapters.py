"""Which LoRA adapter a request runs with, from its ``model`` (docs/engine.md "LoRA adapters").

Called by the aggregated and prefill workers once a request's prompt is prepared: a request
the router placed on this pool names either the pool, its base model (by name or by its KV
identity), ``auto``, or one of the pool's adapters; only the last runs with an adapter. The
engine refuses a name it cannot load (``model_not_found``).
"""

from __future__ import annotations


def adapter_of(model: str, pool: str, base_names: tuple[str, ...]) -> str:
    """The adapter ``model`` names ("" for the pool's base model)."""
    if not model or model in ("auto", pool) or model in base_names:
        return ""
    return model
