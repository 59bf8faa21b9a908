"""Strait's engine: paged KV cache, continuous batching, sampling and detokenization around a
transformers model. Entry points: :class:`~libs.engine.engine.LLMEngine` (synchronous, one
thread) and :class:`~libs.engine.async_engine.AsyncEngineBackend` (the workers' ``Backend``).

The engine owns its inputs: request types and sampling parameters (:mod:`.params`), its
configuration (:mod:`.config`), its errors and outputs (:mod:`.outputs`) and the one check of a
request's inputs (:mod:`.checks`). The wire protocol and the fleet's settings import these;
nothing here imports them (``tests/unit/test_import_graph.py``).

The package imports nothing itself: ``strait up`` reads the compile warm-up's key
(:mod:`.digest`, for :mod:`libs.models.warm`) without loading torch and transformers (~5 s on
2 cores).
"""
