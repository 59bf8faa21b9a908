"""Strait's engine: paged KV cache, continuous batching, sampling and detokenization around a
transformers model. Entry points: :class:`LLMEngine` (synchronous, one thread) and
:class:`~libs.engine.async_engine.AsyncEngineBackend` (the workers' ``Backend``).
"""

from libs.engine.engine import LLMEngine, StepOutput

__all__ = ["LLMEngine", "StepOutput"]
