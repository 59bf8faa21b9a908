"""The engine's settings (`[engine]`, and the per-pool overrides of some of them) and the model
id a model's KV blocks are hashed under. The engine owns them (libs/engine/config.py: the engine
never imports the fleet's settings); the fleet's settings embed them and re-export the names
here for the services that read them from ``libs.settings``."""

from __future__ import annotations

from libs.engine.config import (
    EngineSettings,
    SpeculativeSettings,
    StructuredSettings,
    model_identity,
)

__all__ = ["EngineSettings", "SpeculativeSettings", "StructuredSettings", "model_identity"]
