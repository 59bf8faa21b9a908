"""Strait's settings, one module per owner: ``fleet`` (values several services read, and the
pools), ``wire`` (NATS), ``gateway``, ``router``, ``workers``, ``engine``, ``cache``,
``planner``, ``supervisor``, ``process`` (runtime and telemetry), ``storage`` (database and
models); ``root`` assembles them into ``Settings`` and loads it; ``renames`` keeps moved names
working; ``reference`` renders docs/settings.md. Import from here:
``from libs.settings import Settings, get_settings``.
"""

from libs.settings.cache import CacheSettings
from libs.settings.engine import (
    EngineSettings,
    SpeculativeSettings,
    StructuredSettings,
    model_identity,
)
from libs.settings.fleet import FleetSettings, PoolSettings
from libs.settings.flow import FlowSettings
from libs.settings.gateway import BatchSettings, GatewaySettings
from libs.settings.planner import PlannerSettings, PoolPlanSettings
from libs.settings.process import RuntimeSettings, TelemetrySettings
from libs.settings.root import DEFAULT_CONFIG_PATH, STATE_DIR, Settings, get_settings
from libs.settings.router import ClassifierSettings, RouterSettings, TeamsSettings
from libs.settings.storage import DatabaseSettings, ModelsSettings
from libs.settings.supervisor import SupervisorSettings
from libs.settings.wire import NatsSettings
from libs.settings.workers import FakeEngineSettings, HandoffSettings, WorkerSettings

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "STATE_DIR",
    "BatchSettings",
    "CacheSettings",
    "ClassifierSettings",
    "DatabaseSettings",
    "EngineSettings",
    "FakeEngineSettings",
    "FleetSettings",
    "FlowSettings",
    "GatewaySettings",
    "HandoffSettings",
    "ModelsSettings",
    "NatsSettings",
    "PlannerSettings",
    "PoolPlanSettings",
    "PoolSettings",
    "RouterSettings",
    "RuntimeSettings",
    "Settings",
    "SpeculativeSettings",
    "StructuredSettings",
    "SupervisorSettings",
    "TeamsSettings",
    "TelemetrySettings",
    "WorkerSettings",
    "get_settings",
    "model_identity",
]
