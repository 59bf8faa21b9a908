"""Strait's engine: paged KV cache, continuous batching, sampling and detokenization around a
transformers model. Entry points: :class:`~libs.engine.engine.LLMEngine` (synchronous, one
thread) and :class:`~libs.engine.async_engine.AsyncEngineBackend` (the workers' ``Backend``).

The package imports nothing itself: ``strait up`` reads the compile warm-up's key
(:mod:`libs.engine.warm`) without loading torch and transformers (~5 s on 2 cores).
"""
