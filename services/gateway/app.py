"""The OpenAI-compatible HTTP front door (FastAPI).

``create_app(settings)`` is called by ``services.gateway.main`` (uvicorn) and by tests. It
keeps the process's objects on ``app.state`` (the fleet, the key store, the ``Admission`` of
rate limits and backpressure, the response cache, the stores the lifespan opens) and includes
one router an API (``routes/``: chat and completions, responses, files and batches, models,
health/ready/metrics), which reach those objects through ``deps.py``. A completion passes, in
order: API key (``deps.require_key``) → its ``GenerateRequest`` (``translate.py``) → per-key
rate limits → response cache (``cache.py``) → backpressure → NATS (``admission.py``,
``completions.py``). The lifespan connects to NATS, migrates the database, runs the ledger
writer (``libs.db.ledger``) and the batch runner of this process's ``/v1/batches``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from libs.db import Database
from libs.db.batches import BatchStore
from libs.db.ledger import LedgerWriter
from libs.db.responses import ResponseStore
from libs.runtime import settle_heap
from libs.settings import Settings
from services.gateway.admission import Admission
from services.gateway.auth import KeyStore, OpenKeyStore
from services.gateway.background import BackgroundRuns
from services.gateway.batch_runner import BatchRunner
from services.gateway.body_limit import BodyLimit
from services.gateway.cache import ResponseCache
from services.gateway.errors import install_handlers
from services.gateway.fleet import Fleet
from services.gateway.keystore import DatabaseKeyStore
from services.gateway.limits import RateLimiter
from services.gateway.routes import adapters, admin, batches, completions, models, responses


def create_app(
    settings: Settings, keys: KeyStore | None = None, fleet: Fleet | None = None
) -> FastAPI:
    g = settings.gateway
    app = FastAPI(title="Strait", version="0.1.0", lifespan=lifespan)
    state = app.state
    state.settings = settings
    state.fleet = fleet = fleet or Fleet(settings)
    if keys is None:
        keys = DatabaseKeyStore(settings) if g.auth_enabled else OpenKeyStore()
    state.keys = keys
    state.ledger = state.responses = state.batches = state.batch_runner = None
    state.background = BackgroundRuns(g.background_lease_s)
    state.limiter = limiter = RateLimiter(g.default_rpm, g.default_tpm)
    state.admission = Admission(g, fleet, limiter)
    state.cache = ResponseCache(g)
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=g.max_body_bytes)
    for api in (admin, adapters, models, completions, responses, batches):
        app.include_router(api.router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the fleet connection, the key store, the database and what writes to it (ledger,
    response store, batch runner); stop them in reverse, the background responses first."""
    state = app.state
    settings: Settings = state.settings
    g = settings.gateway
    fleet: Fleet = state.fleet
    keys: KeyStore = state.keys
    await fleet.start()
    db: Database | None = None
    try:
        if isinstance(keys, DatabaseKeyStore):
            await keys.start()
        if g.ledger_enabled or g.store_responses:
            db = keys.db if isinstance(keys, DatabaseKeyStore) else Database(settings)
            await db.migrate()
        if g.ledger_enabled:
            assert fleet.js is not None and db is not None
            state.ledger = LedgerWriter(settings, fleet.js, db)
            await state.ledger.start()
        state.responses = ResponseStore(db) if g.store_responses and db else None
        if state.responses is not None:
            state.background.start_keeper(state.responses)
        state.batches = BatchStore(db) if db else None
        if db is not None and settings.batch.runner_enabled:
            state.batch_runner = BatchRunner(settings, fleet, state.batches)
            await state.batch_runner.start()
        settle_heap(settings)
        yield
    finally:
        # Before the database closes: each stops as a stored "failed" response.
        await state.background.stop(g.background_stop_s)
        if state.batch_runner is not None:
            await state.batch_runner.stop()
        if state.ledger is not None:
            await state.ledger.stop()
        await fleet.stop()
        if isinstance(keys, DatabaseKeyStore):
            await keys.close()
        elif db is not None:
            await db.close()
