"""What the whole fleet agrees on: values more than one service reads (``[fleet]``), and the
pools every service knows (``[[pools]]``).

A value lives in ``[fleet]`` when services of different roles must hold the same one: the
gateway, router, planner and workers all judge a worker's liveness by ``worker_ttl_s``.
"""

from __future__ import annotations

from typing import Literal

from libs.settings.engine import SpeculativeSettings
from libs.settings.section import Section


class FleetSettings(Section):
    """Read by several services; give every process the same values (one settings file)."""

    worker_ttl_s: float = 1.5
    """Seconds without a beat after which a worker is not live: the router drops it and moves
    its requests, the gateway and planner stop counting it, and the worker itself stops
    writing its streams (they run elsewhere by then). Keep several `worker.beat_interval_s`
    within it."""
    retry_after_s: float = 2.0
    """Seconds a client is told to wait (`retry_after_s`, HTTP `Retry-After`) when the fleet
    cannot place its request: the router's no_worker and no_capacity, a prefill worker's
    no_worker or failed handoff. The gateway's own load shedding has its own
    (`gateway.shed_retry_after_s`)."""
    replace_lost: bool = True
    """Place a request again when its worker stops beating: from scratch before its first
    token, as a migration (the tokens streamed so far carried over) after it. Workers read it
    too: a draining worker leaves its unfinished requests to migrate instead of ending them
    with worker_lost."""


class PoolSettings(Section):
    """One `[[pools]]` entry: a model served by its own workers; requests choose a pool by name,
    by model, or through the router's difficulty classes (`model: "auto"`)."""

    name: str = "default"
    """The pool's name: requests name it (or its model) in `model`; workers join it with
    `worker.pool`."""
    model: str = "smollm2-135m-instruct"
    """Model the pool serves: a name of the model registry (`strait models list`) or a local
    directory."""
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    """"aggregated": one worker does prefill and decode. "disaggregated": separate roles."""
    workers: int = 1
    """Workers `strait up` starts for this pool."""
    prefill_workers: int = 1
    """Prefill workers `strait up` starts for a disaggregated pool."""
    backend: Literal["engine", "fake"] = "engine"
    """"engine": the real engine; "fake": timed fake tokens (`fake_engine`), for load tests."""
    quantization: Literal["none", "gguf", "int4", "int8"] | None = None
    """This pool's engine.quantization (None: engine's)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """This pool's engine.dtype (None: engine's)."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """This pool's engine.kv_cache_dtype (None: engine's)."""
    speculative: SpeculativeSettings | None = None
    """This pool's engine.speculative (None: engine's)."""
    itl_target_ms: float | None = None
    """This pool's engine.itl_target_ms (None: engine's)."""
    adapters_dir: str = ""
    """LoRA adapters this pool serves: `<adapters_dir>/<name>/` in PEFT's format
    (`adapter_config.json` + `adapter_model.safetensors`); a request names one in `model`.
    Its workers load them on demand (up to engine.max_loras, which must be > 0); "": none."""
