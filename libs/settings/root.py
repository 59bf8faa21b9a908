"""One settings object for every Strait process.

Loaded once per process by ``get_settings()``: defaults (each section's module), then the TOML
file named by ``STRAIT_CONFIG`` (default ``configs/strait.toml`` when it exists), then
``STRAIT_*`` environment variables (nested fields with ``__``: ``STRAIT_GATEWAY__PORT=9000``).
``NATS_URL`` and ``DATABASE_URL`` are also read without the prefix, as operators expect. Names
that moved still apply, with a warning (libs/settings/renames.py). docs/settings.md lists every
field (``python -m libs.settings.reference`` writes it).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from libs.settings.cache import CacheSettings
from libs.settings.engine import EngineSettings
from libs.settings.fleet import FleetSettings, PoolSettings
from libs.settings.flow import FlowSettings
from libs.settings.gateway import BatchSettings, GatewaySettings
from libs.settings.planner import PlannerSettings
from libs.settings.process import RuntimeSettings, TelemetrySettings
from libs.settings.renames import RenamingSource
from libs.settings.router import RouterSettings, TeamsSettings
from libs.settings.storage import DatabaseSettings, ModelsSettings
from libs.settings.supervisor import SupervisorSettings
from libs.settings.wire import NatsSettings
from libs.settings.workers import FakeEngineSettings, HandoffSettings, WorkerSettings

DEFAULT_CONFIG_PATH = Path("configs/strait.toml")
STATE_DIR = Path(".strait")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STRAIT_",
        env_nested_delimiter="__",
        extra="ignore",
        # Settings(state_dir=...) in code and tests, STRAIT_STATE_DIR in the environment.
        populate_by_name=True,
    )

    fleet: FleetSettings = Field(default_factory=FleetSettings)
    """Values several services read: worker liveness, Retry-After, re-placement."""
    nats: NatsSettings = Field(default_factory=NatsSettings)
    """The NATS connection, subject prefix and JetStream streams of every process."""
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    """The OpenAI-compatible HTTP gateway (`strait gateway`, docs/gateway.md)."""
    batch: BatchSettings = Field(default_factory=BatchSettings)
    """The Batch API (docs/gateway.md): its runners in the gateways, its room in the pools."""
    router: RouterSettings = Field(default_factory=RouterSettings)
    """The router (`strait router`, docs/router.md): pool choice, placement, re-placement."""
    teams: TeamsSettings = Field(default_factory=TeamsSettings)
    """Teams on NATS (docs/security.md), whose limits the router enforces."""
    flow: FlowSettings = Field(default_factory=FlowSettings)
    """Flow control between tenants (docs/flow-control.md): waiting bounds and deadlines."""
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    """A worker process (`strait decode`, `strait prefill`): its identity, beats and drain."""
    handoff: HandoffSettings = Field(default_factory=HandoffSettings)
    """Disaggregated pools' prefill -> decode KV handoff (docs/disaggregation.md)."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    """The engine each worker runs (docs/engine.md); a pool may replace some of it."""
    fake_engine: FakeEngineSettings = Field(default_factory=FakeEngineSettings)
    """The fake backend's timing model (pools with `backend = "fake"`)."""
    pools: list[PoolSettings] = Field(default_factory=lambda: [PoolSettings()])
    """The pools of the fleet (`[[pools]]`, one table each)."""
    cache: CacheSettings = Field(default_factory=CacheSettings)
    """The prefix-cache service (`strait cache`, docs/cache.md) and its client in workers."""
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    """The planner (`strait planner`, docs/planner.md): sizes each pool ahead of its load."""
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    """`strait up`'s supervisor: restarts of crashed children, its /metrics."""
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    """Where models are converted to, and whether their packages are installed."""
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """The database of keys, the ledger, batches and stored responses."""
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    """Logs, traces and the /health, /ready, /metrics listener's address, in every process."""
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    """How every service process runs: event loop, garbage collector."""
    state_dir: str = Field(
        default=str(STATE_DIR), validation_alias=AliasChoices("STRAIT_STATE_DIR")
    )
    """Where a machine's fleet keeps its state: the SQLite database, secure NATS files, compiled
    graphs (`STRAIT_STATE_DIR`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = Path(os.environ.get("STRAIT_CONFIG", str(DEFAULT_CONFIG_PATH)))
        toml = TomlConfigSettingsSource(settings_cls, toml_file=path if path.exists() else None)
        return tuple(RenamingSource(src) for src in (init_settings, env_settings, toml))

    def model_post_init(self, __context: Any) -> None:
        # Operators' conventional names win over the file, lose to STRAIT_* (already applied).
        if "NATS_URL" in os.environ and "STRAIT_NATS__URL" not in os.environ:
            self.nats.url = os.environ["NATS_URL"]
        if "DATABASE_URL" in os.environ and "STRAIT_DATABASE__URL" not in os.environ:
            self.database.url = os.environ["DATABASE_URL"]

    def pool(self, name: str) -> PoolSettings | None:
        return next((p for p in self.pools if p.name == name), None)

    def engine_for(self, pool: PoolSettings) -> EngineSettings:
        """``engine`` with the pool's own weight-format and speculation overrides applied."""
        fields = ("quantization", "dtype", "kv_cache_dtype", "speculative", "itl_target_ms")
        update = {f: getattr(pool, f) for f in fields if getattr(pool, f) is not None}
        if pool.adapters_dir:
            update["lora_dir"] = pool.adapters_dir
        return self.engine.model_copy(update=update) if update else self.engine

    @property
    def compile_cache_dir(self) -> Path:
        """Where inductor keeps compiled graphs (``engine.compile``) for ``strait up``'s
        processes (``TORCHINDUCTOR_CACHE_DIR``; libs/models/warm.py fills it ahead)."""
        return Path(self.state_dir).resolve() / "inductor"

    @property
    def kernels_cache_dir(self) -> Path:
        """Where torch builds Strait's CPU kernels for ``strait up``'s processes
        (``TORCH_EXTENSIONS_DIR``; ``make kernels`` builds there ahead): per state dir, so two
        checkouts on one machine never rebuild each other's build (torch's shared default
        directory is keyed by name, and a build from other source paths is rebuilt)."""
        return Path(self.state_dir).resolve() / "torch_extensions"

    @property
    def teams_file(self) -> Path:
        if self.teams.file:
            return Path(self.teams.file)
        return Path(self.state_dir) / "secure" / "teams.json"

    @property
    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite+aiosqlite:///{Path(self.state_dir).resolve() / 'strait.db'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings; tests build their own `Settings(...)` instead."""
    return Settings()
