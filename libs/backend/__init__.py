"""The contract between a worker service and whatever generates tokens.

Implemented by the real engine (``libs.engine.async_engine.AsyncEngineBackend``) and by the fake
backend (``libs.backend.fake.FakeBackend``, load tests only). The worker calls ``prepare`` on its
own event loop (cheap validation + tokenization), then iterates ``generate``; it calls ``abort``
on cancel. ``load`` is read for every beat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

# The engine owns the types of this contract (libs/engine/errors.py, outputs.py, params.py);
# they are re-exported here for the workers.
from libs.engine.errors import BackendError  # noqa: F401
from libs.engine.outputs import (
    GenerationChunk,
    LoadInfo,
    PreparedPrompt,
    Resume,
)
from libs.engine.params import ChatMessage, Priority, SamplingParams, Tenant
from libs.engine.tools import ToolSpec


class Backend(Protocol):
    model_name: str
    # Name plus weights' format (libs.engine.config.model_identity): the key KV blocks hash under.
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
        tenant: Tenant | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until every choice has a finish_reason. Closing the iterator early
        aborts the request and frees its blocks. ``resume``: continue after a handed-off first
        token (backends without KV handoff raise BackendError). ``tenant``: who it is served
        as in the backend's fair share of tokens (libs/flow)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def load(self) -> LoadInfo: ...
