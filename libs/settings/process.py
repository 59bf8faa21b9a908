"""How every service process runs (event loop, garbage collector) and reports (logs, traces,
the /health, /ready, /metrics listener's address)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libs.settings.section import Section


class RuntimeSettings(Section):
    """How each service process runs (gateway, router, workers, cache): what a streamed token
    costs them, docs/performance.md#gateway-under-load-fake-engine."""

    event_loop: Literal["uvloop", "asyncio"] = "asyncio"
    """"asyncio" (the standard library's loop) or "uvloop" (libuv): uvloop streams more tokens a
    second through one gateway, but a busy gateway on it hit by thousands of new connections
    at once left some waiting a minute (decision 0015)."""
    gc_freeze: bool = True
    """Once started (modules imported, connections open, model loaded), move every live object
    out of the cyclic collector's reach (gc.freeze): its full collections then scan only
    what serving allocated, not the libraries' start-up heap."""
    gc_freeze_interval_s: float = Field(default=1.0, ge=0)
    """With gc_freeze, seconds between freezes of what serving allocated since (collections then
    scan at most this long's survivors); 0: never (libs/runtime.HeapKeeper)."""
    gc_sweep_interval_s: float = Field(default=600.0, ge=0)
    """Seconds between sweeps that thaw and fully collect the frozen heap (cycles among
    frozen objects wait this long); 0: never."""


class TelemetrySettings(Section):
    service_namespace: str = "strait"
    """OpenTelemetry `service.namespace` of every process's traces."""
    log_level: str = "INFO"
    """Level of the log (DEBUG, INFO, WARNING, ERROR)."""
    log_json: bool = True
    """One JSON object a log line (false: plain text)."""
    http_host: str = "127.0.0.1"
    """Address of the /health, /ready, /metrics listener of router and workers; containers need
    0.0.0.0 so probes and Prometheus reach it."""
