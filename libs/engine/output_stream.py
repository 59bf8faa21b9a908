"""One request's outputs on their way from the engine thread to the request's consumer (the
worker, then NATS): :class:`OutputStream`, filled on the event loop by
:class:`~libs.engine.async_engine.AsyncEngineBackend` and drained by ``generate``. When the
consumer fell behind by several steps, the outputs of one choice it finds waiting come merged
into one chunk (frames coalesce rather than queue up one message per token); :data:`END`
marks an aborted request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from libs.engine.engine import StepOutput
from libs.engine.outputs import GenerationChunk

END = object()  # stream sentinel: the request was aborted, no more chunks


class OutputStream:
    """One request's outputs, filled by the event loop (``put``), drained by its consumer."""

    __slots__ = ("items", "ready")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.ready = asyncio.Event()

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self) -> Any:
        """The next item; consecutive outputs of one choice already waiting come merged."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        while isinstance(item, StepOutput) and self.items and mergeable(item, self.items[0]):
            item = merge(item, self.items.popleft())
        return item


def mergeable(a: StepOutput, b: Any) -> bool:
    return (
        isinstance(b, StepOutput)
        and b.chunk.index == a.chunk.index
        and a.chunk.finish_reason is None
    )


def merge(a: StepOutput, b: StepOutput) -> StepOutput:
    """``a`` then ``b`` (the same choice) as one output."""
    x, y = a.chunk, b.chunk
    logprobs = (
        None
        if x.logprobs is None and y.logprobs is None
        else (x.logprobs or []) + (y.logprobs or [])
    )
    chunk = GenerationChunk(
        index=x.index,
        text=x.text + y.text,
        token_ids=x.token_ids + y.token_ids,
        finish_reason=y.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=y.num_prompt_tokens,
        num_cached_tokens=y.num_cached_tokens,
        num_spec_proposed=y.num_spec_proposed,
        num_spec_accepted=y.num_spec_accepted,
    )
    return StepOutput(b.request_id, chunk, b.request_finished)
