"""The fleet's hand-off to the engine: a pool's settings turned into a started-ready
:class:`~libs.engine.async_engine.AsyncEngineBackend`.

The engine takes only its own config (``libs.engine.config.EngineSettings``) and local model
directories; this module resolves a pool's model (and a speculative draft model) to those
directories, converting once (:func:`libs.models.prepare_model`), and picks the pool's engine
config (``Settings.engine_for``). Called by the workers' entry points at start-up
(``services/worker/process.py``, ``services/prefill/main.py``).
"""

from __future__ import annotations

from libs.engine.async_engine import AsyncEngineBackend
from libs.models.prepare import prepare_model
from libs.settings import PoolSettings, Settings


def engine_backend(settings: Settings, pool: PoolSettings) -> AsyncEngineBackend:
    """``pool``'s engine backend, built with the pool's engine settings (its weights' format);
    not started."""
    path = prepare_model(pool.model, settings)
    engine = settings.engine_for(pool)
    draft = None
    if engine.speculative.method == "draft":
        draft = str(prepare_model(engine.speculative.draft_model, settings))
    return AsyncEngineBackend(engine, str(path), pool.model, draft)
