"""Draft-model proposer (``speculative.method = "draft"``): a smaller model sharing the
target's vocabulary proposes ``k`` tokens greedily.

Owned by the engine's :class:`~libs.engine.spec.Speculator`; runs on the engine thread. The
draft model has its own :class:`~libs.engine.model_runner.ModelRunner` (its own paged KV cache
of ``speculative.draft_kv_cache_bytes``, no prefix caching, never compiled) and one shadow
sequence per speculating sequence (``Sequence.spec_index``) holding the draft's blocks. Each proposal first brings the shadow up to the sequence's verified
tokens — recomputing from the first position where its last proposals were not kept — then runs
one forward per proposed token. Greedy proposals are point masses, so the engine's
sample-and-compare verification is exact for them (decision 0013).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.engine.block_pool import BlockPool
from libs.engine.config import EngineSettings, SpeculativeSettings
from libs.engine.kv_manager import KvManager
from libs.engine.model_runner import ModelRunner
from libs.engine.scheduler import ScheduledSeq
from libs.engine.sequence import Sequence


@dataclass(slots=True)
class _Shadow:
    """The draft's copy of one speculating sequence (``Sequence.spec_index``)."""

    seq: Sequence  # its tokens (verified, then the last proposals) and the draft's blocks
    verified: int = 0  # tokens of the target sequence the shadow held at its last proposal


class DraftProposer:
    name = "draft"

    def __init__(
        self, s: SpeculativeSettings, model: torch.nn.Module, engine: EngineSettings
    ) -> None:
        draft_engine = engine.model_copy(
            update={
                "kv_cache_bytes": s.draft_kv_cache_bytes,
                "compile": False,
                "enable_prefix_caching": False,
            }
        )
        self.runner = ModelRunner(model, draft_engine)
        self.pool = BlockPool(self.runner.num_blocks, draft_engine.block_size, False)
        self.kv = KvManager(self.pool, "draft")

    @property
    def vocab_size(self) -> int:
        return self.runner.shape.vocab_size

    def propose(self, seq: Sequence, k: int) -> list[int]:
        state: _Shadow | None = seq.spec_index
        if state is None:
            state = _Shadow(Sequence(seq.request_id, seq.index, [], 0, seq.sampling))
            seq.spec_index = state
        shadow = state.seq
        # The shadow's K/V are valid up to the first token where it and the sequence differ
        # (a proposal that was not kept); the sequence itself only ever grows, so only the
        # tokens after those it held verified at the last proposal are compared.
        tokens = seq.token_ids
        # At least the last token runs again: its logits give the first proposal (a sequence
        # the scheduler left out of the last step still has the shadow ahead of it).
        same = min(shadow.num_computed_tokens, len(tokens) - 1)
        for i in range(state.verified, same):
            if shadow.token_ids[i] != tokens[i]:
                same = i
                break
        shadow.token_ids = list(tokens)
        state.verified = len(tokens)
        shadow.num_computed_tokens = same
        # Catch up to the last verified token (sampling there), then one token per proposal.
        if not self.kv.can_grow(shadow, len(tokens) - same + k):
            return []
        out: list[int] = []
        n = len(tokens) - same
        while len(out) < k:
            self.kv.grow(shadow, n)
            logits = self.runner.execute([ScheduledSeq(shadow, n)])  # [1, vocab]
            shadow.num_computed_tokens += n
            token = int(logits[0].argmax())
            out.append(token)
            shadow.token_ids.append(token)
            n = 1
        return out

    def finished(self, seq: Sequence) -> None:
        state = seq.spec_index
        if isinstance(state, _Shadow):
            self.kv.free(state.seq)
        seq.spec_index = None


__all__ = ["DraftProposer"]
