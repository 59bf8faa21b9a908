"""Fewer stream messages for batch requests: their tokens sent in deltas of several tokens.

A ``priority: "batch"`` request is read whole (the Batch API's runner collects it), so a delta a
token buys its reader nothing, while every delta costs the worker a publish, nats-server a
message, the router a decode (it watches every stream it placed) and the reader a decode: work
on the same event loops and cores as the interactive requests beside it. ``DeltaHold`` keeps
each choice's chunks until ``worker.batch_delta_tokens`` tokens or the choice's end, and
hands them on as one chunk; the stream stays what the protocol says (docs/nats-api.md: a delta
may carry several tokens; concatenate). Interactive requests are never held.
"""

from __future__ import annotations

from libs.engine.outputs import GenerationChunk


class DeltaHold:
    """Per choice, the chunks not yet sent, merged into one."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.held: dict[int, GenerationChunk] = {}

    def add(self, chunk: GenerationChunk, last: bool) -> GenerationChunk | None:
        """``chunk`` merged with what its choice holds: returned once it has ``tokens`` tokens
        or ``last`` (the choice ended, or carries tool calls), else held (None)."""
        before = self.held.pop(chunk.index, None)
        if before is not None:
            logprobs = (
                None
                if before.logprobs is None and chunk.logprobs is None
                else [*(before.logprobs or []), *(chunk.logprobs or [])]
            )
            chunk = GenerationChunk(
                index=chunk.index,
                text=before.text + chunk.text,
                token_ids=[*before.token_ids, *chunk.token_ids],
                finish_reason=chunk.finish_reason,
                logprobs=logprobs,
                num_prompt_tokens=chunk.num_prompt_tokens,
                num_cached_tokens=chunk.num_cached_tokens,
                num_spec_proposed=chunk.num_spec_proposed,
                num_spec_accepted=chunk.num_spec_accepted,
            )
        if last or chunk.finish_reason is not None or len(chunk.token_ids) >= self.tokens:
            return chunk
        self.held[chunk.index] = chunk
        return None
