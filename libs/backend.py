"""The contract between a worker service and whatever generates tokens.

Implemented by the real engine (``libs.engine.async_engine.AsyncEngineBackend``) and by the fake
backend (``libs.fake_engine.FakeBackend``, load tests only). The worker calls ``prepare`` on its
own event loop (cheap validation + tokenization), then iterates ``generate``; it calls ``abort``
on cancel. ``load`` is read for every beat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from libs.protocol import (
    ChatMessage,
    ErrorCode,
    FinishReason,
    LogprobEntry,
    Priority,
    SamplingParams,
)
from libs.tools import ToolSpec


class BackendError(Exception):
    """A request the backend refuses; ``code`` is an ``ErrorMessage`` code."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param
        self.retry_after_s = retry_after_s


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
    # Chain hashes stored/evicted since the last call (drained by the worker into KvEvents).
    stored_hashes: list[int] = field(default_factory=list)
    evicted_hashes: list[int] = field(default_factory=list)


class Backend(Protocol):
    model_name: str
    # Name plus weights' format (libs.settings.model_identity): the key KV blocks hash under.
    model_id: str
    max_model_len: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def prepare(
        self,
        *,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        messages: list[ChatMessage] | None,
        sampling: SamplingParams,
        tools: ToolSpec | None = None,
    ) -> PreparedPrompt:
        """Apply the chat template (with ``tools``) / tokenize, validate, compile the request's
        grammar. Raises BackendError (``context_length_exceeded`` when prompt + max_tokens
        exceed the model's context, ``invalid_request`` for bad token ids or an invalid
        constraint). Workers call it on a thread, off their event loop."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        priority: Priority,
        resume: Resume | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until every choice has a finish_reason. Closing the iterator early
        aborts the request and frees its blocks. ``resume``: continue after a handed-off first
        token (backends without KV handoff raise BackendError)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def load(self) -> LoadInfo: ...
