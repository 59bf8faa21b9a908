"""The digest of what shapes an engine's compiled graphs apart from its model.

:func:`libs.engine.aot.graph_key` keys the saved graphs with it; the compile warm-up
(:mod:`libs.models.warm`, run by ``strait up``) keys its markers with it, so a settings, version,
CPU or source change makes both a new key. It imports no torch itself (``strait up`` reads it
without loading the engine).
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version
from pathlib import Path

from libs.engine import kernels
from libs.engine.config import EngineSettings

# Engine settings that do not shape the graph: the KV budget is a symbolic size, speculation
# runs the same graphs, and the artifact directory is where the graphs live, not what they are.
UNSHAPING = {
    "kv_cache_bytes",
    "kv_cache_memory_fraction",
    "speculative",
    "compile_dir",
    "compile_background",
    # Scheduling: how many tokens a step carries, not the graphs that run them.
    "itl_target_ms",
    "min_prefill_tokens",
    "fair_share",
    "fair_prompt_token_cost",
    "fair_headroom_seqs",
    "fair_preempt",
    "fair_first_prompt_alone_every",
    "fair_shared_max_num_seqs",
    "fair_shared_window_s",
    # CUDA only: they shape no CPU graph.
    "cuda_graphs",
    "cuda_graph_batch_sizes",
    "cuda_graph_max_tokens",
    "cuda_run_ahead",
    "cuda_attention",
    # Where LoRA adapters are read from (engine.max_loras / max_lora_rank do shape it).
    "lora_dir",
}
# Shape only CUDA graphs (the captured batch buckets, model_runner's DecodeGraphs); on a CPU
# the compiled forward is dynamic in its rows, so changing them there needs no new compile.
CUDA_SHAPING = {"max_num_seqs"}
# Modules whose source shapes the compiled graph, relative to libs/engine.
GRAPH_SOURCES = (
    "model_runner.py",
    "loader.py",
    "aot.py",
    "attention.py",
    "fuse.py",
    *(f"kernels/{path.name}" for path in (*kernels.SOURCES, *kernels.HEADERS)),
    "kernels/ops.py",
    "kernels/linear.py",
    "quant/__init__.py",
    "quant/blocks.py",
    "quant/base.py",
    "quant/gguf.py",
    "quant/serve.py",
    "quant/int4.py",
    "quant/int8.py",
    "lora/layers.py",
)


def engine_digest(engine: EngineSettings) -> bytes:
    """What decides a pool's compiled graphs apart from its model: the engine settings that
    shape them, the thread count, torch's and transformers' versions, this CPU's features and
    the source of every module in :data:`GRAPH_SOURCES`. Shared by :func:`libs.models.warm.warm_key`
    and :func:`libs.engine.aot.graph_key`."""
    h = hashlib.sha256()
    cpu = engine.device == "cpu"
    h.update(engine.model_dump_json(exclude=UNSHAPING | (CUDA_SHAPING if cpu else set())).encode())
    # The threads the workers will run (inductor's kernels are generated for a thread count;
    # OMP_NUM_THREADS changes it as much as engine.num_threads does).
    h.update(f"threads {engine.threads()}\n".encode())
    for pkg in ("torch", "transformers"):
        h.update(f"{pkg} {version(pkg)}\n".encode())
    h.update(kernels.cpu_tag().encode())
    here = Path(__file__).parent  # libs/engine
    for name in GRAPH_SOURCES:
        h.update((here / name).read_bytes())
    return h.digest()
