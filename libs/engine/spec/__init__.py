"""Speculative decoding: proposers guess a decoding sequence's next tokens; the engine verifies
them in its next forward.

Called by :meth:`libs.engine.engine.LLMEngine.step`: :meth:`Speculator.propose` before the
scheduler runs (it sets ``Sequence.spec_tokens``), :meth:`Speculator.record` after each
verification, :meth:`Speculator.finished` when a sequence ends. The scheduler runs a sequence's
last token plus its proposals as one chunk; the engine samples each of their positions in
turn, exactly as it would sample them one step at a time, and keeps a proposal only while it
equals the token sampled at its position (docs/speculation.md). So proposals never change the
answer: greedy or seeded, the output is the one without speculation.

Proposers (one module each, behind :class:`Proposer`): ``ngram`` (:mod:`.ngram`, the
sequence's own prompt and output), ``suffix`` (:mod:`.suffix`, then other requests' recent
outputs) and ``draft`` (:mod:`.draft`, a smaller model with the same vocabulary).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from libs.engine import metrics
from libs.engine.config import EngineSettings, SpeculativeSettings
from libs.engine.sequence import Sequence
from libs.engine.spec.ngram import NgramIndex
from libs.engine.spec.prediction import PredictionIndex
from libs.engine.spec.suffix import SuffixCache
from libs.engine.step_cost import StepCost


class Proposer(Protocol):
    """Guesses up to ``k`` next tokens of ``seq`` from verified tokens only."""

    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended (its output is final and verified)."""


class NgramProposer:
    name = "ngram"

    def __init__(self, s: SpeculativeSettings) -> None:
        self.min_n, self.max_n = s.prompt_lookup_min, s.prompt_lookup_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.spec_index is None:
            seq.spec_index = NgramIndex(self.min_n, self.max_n)
        index: NgramIndex = seq.spec_index
        return index.find(seq.token_ids, k)

    def finished(self, seq: Sequence) -> None:
        seq.spec_index = None


class SuffixProposer(NgramProposer):
    name = "suffix"

    def __init__(self, s: SpeculativeSettings) -> None:
        super().__init__(s)
        self.cache = SuffixCache(self.min_n, self.max_n, s.suffix_cache_tokens)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        own = super().propose(seq, k)
        if own:
            return own
        return self.cache.find(seq.token_ids[-self.max_n :], k)

    def finished(self, seq: Sequence) -> None:
        super().finished(seq)
        if seq.finish_reason != "abort":
            self.cache.add(seq.output_token_ids)


PROPOSERS: dict[str, type[NgramProposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}


class PredictionProposer:
    """A request's predicted output first (``Sequence.prediction``, :mod:`.prediction`), then
    the pool's proposer (``inner``; None where the pool has speculation off: then only
    requests with a prediction speculate)."""

    def __init__(self, s: SpeculativeSettings, inner: Proposer | None) -> None:
        self.min_n, self.max_n = s.prompt_lookup_min, s.prompt_lookup_max
        self.inner = inner
        self.name = inner.name if inner is not None else "prediction"

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.prediction:
            if seq.prediction_index is None:
                seq.prediction_index = PredictionIndex(seq.prediction, self.min_n, self.max_n)
            found = seq.prediction_index.find(seq.token_ids, k)
            if found:
                return found
        return self.inner.propose(seq, k) if self.inner is not None else []

    def finished(self, seq: Sequence) -> None:
        seq.prediction_index = None
        if self.inner is not None:
            self.inner.finished(seq)


RATE_WEIGHT = 0.05  # weight of one verification in the worker's acceptance rate


class Speculator:
    """Chooses which sequences speculate how deep each step, and keeps the acceptance figures."""

    def __init__(
        self,
        s: SpeculativeSettings,
        model_id: str,
        max_model_len: int,
        proposer: Proposer,
        prediction_only: bool = False,
    ) -> None:
        self.settings = s
        self.proposer = proposer
        self.max_model_len = max_model_len
        # The pool has speculation off: only sequences with a predicted output speculate.
        self.prediction_only = prediction_only
        labels = {"model": model_id, "method": proposer.name}
        self._proposed = metrics.SPEC_PROPOSED.labels(**labels)
        self._accepted = metrics.SPEC_ACCEPTED.labels(**labels)
        self._length = metrics.SPEC_ACCEPTED_LENGTH.labels(**labels)
        self.num_proposed = 0
        self.num_accepted = 0
        # The decode step-cost fit; the engine shares its own (StepCostModel.decode) with it.
        self.cost = StepCost()
        # Acceptance rate over the worker's recent verifications (EMA): a new sequence's prior.
        self.rate = 1.0

    def ceiling(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may have proposed this step: the pool's depth, the request's
        cap, and never past ``max_tokens`` or the context (the last verified token ends the
        output anyway)."""
        k = self.settings.num_speculative_tokens
        cap = seq.sampling.num_speculative_tokens
        if cap is not None:
            k = min(k, cap)
        room = min(
            seq.sampling.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        return max(0, min(k, room - 1))

    def keep_rate(self, seq: Sequence) -> float:
        """The chance that ``seq``'s next proposed token is kept (its EMA; the worker's recent
        one before it has its own)."""
        return self.rate if seq.spec_rate is None else seq.spec_rate

    def idle(self, seq: Sequence, k: int) -> int:
        """``k``, or after ``adaptive_probe_steps`` steps at 0 one token: has the sequence
        turned predictable again?"""
        if k:
            return k
        seq.spec_idle += 1
        return 0 if seq.spec_idle < self.settings.adaptive_probe_steps else 1

    def depth(self, seq: Sequence, break_even: float = 0.0) -> int:
        """Before the step cost is fitted (or without ``adaptive``): the ceiling, scaled by the
        keep rate, and 0 while that rate is below ``break_even`` (adaptive only)."""
        k = self.ceiling(seq)
        if k and self.settings.adaptive:
            rate = self.keep_rate(seq)
            k = self.idle(seq, round(k * rate) if rate >= break_even else 0)
        return k

    def allocate(
        self, decoding: Seq[Sequence], offered: list[list[int]], a: float, b: float
    ) -> list[int]:
        """How many of its ``offered`` proposals each decoding sequence runs, with the step
        costing ``a + b * rows`` seconds: the batch's expected tokens per second, greedily.
        Proposal ``j`` of a sequence that keeps each token with chance ``p`` is worth
        ``p ** j`` tokens (it counts only if the ``j - 1`` before it were kept) and costs ``b``;
        it runs while it lifts tokens / time, i.e. while ``p ** j * time > b * tokens``, best
        first. One stream keeping 90% runs 7 (a = 5 ms, b = 1.25 ms); 32 streams keeping 77%
        run none."""
        a = max(a, 0.0)
        tokens, time = float(len(decoding)), a + b * len(decoding)
        heap: list[tuple[float, int, int, float]] = []  # (-gain, sequence, j, p)
        for i, seq in enumerate(decoding):
            if offered[i]:
                p = self.keep_rate(seq)
                heap.append((-p, i, 1, p))
        heapq.heapify(heap)
        depth = [0] * len(decoding)
        while heap and -heap[0][0] * time > b * tokens:
            neg, i, j, p = heapq.heappop(heap)
            depth[i] = j
            tokens, time = tokens - neg, time + b
            if j < len(offered[i]):
                heapq.heappush(heap, (neg * p, i, j + 1, p))
        return depth

    def propose(self, running: Seq[Sequence]) -> None:
        """Set ``spec_tokens`` of every running sequence for the coming step. Once the step
        cost is fitted, each sequence's proposals are asked for up to its ceiling and kept
        as far as ``allocate`` finds them worth their rows."""
        decoding = [s for s in running if not s.is_prefilling]
        for seq in running:
            seq.spec_tokens = []
        if len(decoding) > self.settings.disable_by_batch_size:
            return
        # Where the pool has speculation off, only sequences with a predicted output propose.
        proposing = [not self.prediction_only or bool(s.prediction) for s in decoding]
        fit = self.cost.fit() if self.settings.adaptive else None
        if fit is None or fit[1] <= 0:
            need = self.cost.break_even(len(decoding))
            for seq, on in zip(decoding, proposing, strict=True):
                k = self.depth(seq, need) if on else 0
                if k:
                    seq.spec_tokens = self.proposer.propose(seq, k)
            return
        offered = []
        for seq, on in zip(decoding, proposing, strict=True):
            k = self.ceiling(seq) if on else 0
            offered.append(self.proposer.propose(seq, k) if k else [])
        for seq, k, tokens in zip(
            decoding, self.allocate(decoding, offered, *fit), offered, strict=True
        ):
            seq.spec_tokens = tokens[: self.idle(seq, k)]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verification of ``seq``: ``accepted`` of its ``proposed`` tokens were kept."""
        seq.spec_proposed += proposed
        seq.spec_accepted += accepted
        self.num_proposed += proposed
        self.num_accepted += accepted
        self._proposed.inc(proposed)
        self._accepted.inc(accepted)
        self._length.observe(accepted)
        # Each proposed token is kept only if every one before it was: ``accepted`` kept
        # tokens and one rejection (none when all were kept) estimate the chance of keeping one.
        kept = accepted / (accepted + (accepted < proposed))
        w = self.settings.adaptive_weight
        seq.spec_rate = (1 - w) * self.keep_rate(seq) + w * kept
        self.rate = (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * kept
        seq.spec_idle = 0

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only forward of ``rows`` tokens took ``seconds`` (the engine, each step)."""
        self.cost.add(rows, seconds)


def make_speculator(
    engine: EngineSettings,
    model_id: str,
    max_model_len: int,
    vocab_size: int,
    draft_model: torch.nn.Module | None = None,
) -> Speculator:
    """The engine's speculator: the pool's method behind requests' predicted outputs; with
    ``engine.speculative.method`` "off", predicted outputs alone. The "draft" method needs
    ``draft_model`` loaded (with ``vocab_size`` tokens, the target's)."""
    s = engine.speculative
    if s.method == "off":
        return Speculator(
            s, model_id, max_model_len, PredictionProposer(s, None), prediction_only=True
        )
    proposer: Proposer
    if s.method == "draft":
        from libs.engine.spec.draft import DraftProposer

        if draft_model is None:
            raise ValueError('speculative.method = "draft" needs the draft model loaded')
        draft = DraftProposer(s, draft_model, engine)
        if draft.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                f"target's ({vocab_size})"
            )
        proposer = draft
    else:
        proposer = PROPOSERS[s.method](s)
    return Speculator(s, model_id, max_model_len, PredictionProposer(s, proposer))


__all__ = [
    "PROPOSERS",
    "NgramProposer",
    "PredictionProposer",
    "Proposer",
    "Speculator",
    "SuffixProposer",
]
