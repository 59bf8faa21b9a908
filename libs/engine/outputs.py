"""What the engine hands back: a request's prompt as it will run (:class:`PreparedPrompt`), the
output it streams (:class:`GenerationChunk`), the load it reports (:class:`LoadInfo`), and an
output begun elsewhere that it continues (:class:`Resume`).

Produced by :class:`~libs.engine.async_engine.AsyncEngineBackend` and the fake backend, read by
the workers through ``libs.backend.Backend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libs.engine.params import FinishReason, LogprobEntry


@dataclass(slots=True)
class PreparedPrompt:
    """A request's prompt as the backend will run it."""

    token_ids: list[int]
    # Prompt text is kept only for the fake backend's length model; never logged.
    text: str = ""
    # The request's constraint as validated llguidance grammar text (None: unconstrained), and
    # one matcher per choice built from it off the engine's thread (llguidance parses the
    # grammar when a matcher is made: milliseconds for a large schema).
    grammar: str | None = None
    matchers: list[Any] = field(default_factory=list)
    # SamplingParams.prediction's tokens (speculation proposes from them first).
    prediction_ids: list[int] = field(default_factory=list)
    # The LoRA adapter the request runs with ("": the base model; engine.max_loras), set by
    # the worker from the request's model name (services/worker/adapters.py).
    lora: str = ""


@dataclass(slots=True)
class Resume:
    """A request whose output began elsewhere. The engine appends the given tokens as if it had
    sampled them — same detokenizer, stop, grammar and penalty state, same seeded random stream
    (one draw skipped per token) — and continues after them.

    - ``replayed``: output tokens another worker already streamed (a migration); appended and
      never reported again.
    - ``token_id``: the next token, sampled elsewhere and not yet streamed (the prefill worker of
      a KV handoff); reported in the first chunk with ``logprobs``. None: the engine samples it.
    """

    token_id: int | None = None
    logprobs: LogprobEntry | None = None
    replayed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class GenerationChunk:
    """New output of one choice since the last chunk. Yielded by ``Backend.generate``."""

    index: int  # choice index, 0..n-1
    text: str  # new detokenized text (never half a UTF-8 character)
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobEntry] | None = None
    # Set on every chunk; the worker reports the last values it saw.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Speculative decoding so far: tokens proposed and kept (libs/engine/spec).
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0


@dataclass(slots=True)
class LoadInfo:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    capacity: int = 0  # max running sequences
    block_size: int = 16
    # The running decode rows' predicted step time over the ITL target (engine.itl_target_ms):
    # at 1 they alone fill it, and every prompt this worker takes runs at the floor of
    # min_prefill_tokens a step. 0: no target, or no fit yet.
    step_load: float = 0.0
    # LoRA adapters loaded now (engine.max_loras), announced in the worker's beats.
    adapters: list[str] = field(default_factory=list)
    # What the steps run (ModelRunner.forward_kind): "compiled", "eager", "compiling".
    forward: str = ""
    # Chain hashes stored/evicted since the last call (drained by the worker into KvEvents).
    stored_hashes: list[int] = field(default_factory=list)
    evicted_hashes: list[int] = field(default_factory=list)
