"""Turns the logits of the rows that sample this step into tokens (and log-probabilities).

Called by the engine once per step with one logits row per sampled position and one
:class:`SamplingRow` per row (a row of a prompt's last token appears ``n`` times when the
request forks into ``n`` choices). Order of processing per row, as in the OpenAI/HF APIs:

0. ``logit_bias`` added, then the grammar's mask (rows whose sequence has a matcher: tokens the
   grammar does not allow next get -inf; see ``libs.engine.structured``);
1. penalties: repetition (HF semantics: prompt + output tokens, divide positive logits /
   multiply negative ones), then frequency and presence (OpenAI: output tokens only);
2. log-probabilities, when asked, from the penalised logits before temperature;
3. greedy (temperature 0 or top-k 1): arg-max (on the logits' device when every row is plain
   greedy, :func:`device_greedy`: one copy of the token ids back); otherwise temperature, top-k, top-p, min-p, and
   a draw by the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``), where ``E`` comes
   from the row's own ``torch.Generator`` when the request has a seed — so a seeded request
   draws the same numbers whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libs.engine.params import SamplingParams
from libs.engine.structured import MaskKernel, mask_rows


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about the sequence behind one logits row."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the sampler's shared generator
    token_ids: Sequence[int]  # prompt + output (repetition penalty)
    output_counts: dict[int, int]  # output token id → count (frequency/presence penalties)
    matcher: Any = None  # llguidance matcher of a constrained sequence


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top alternatives (ids, not text)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless apart from the shared generator used by unseeded requests."""

    def __init__(
        self,
        seed: int | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mask: MaskKernel | None = None,
    ) -> None:
        """``argmax``: float32 ``[S, V]`` -> int64 ``[S]``, equal to ``torch.argmax(x, -1)``
        (the engine passes the CPU kernels' ``argmax_rows``); ``None``: torch's. ``mask``: the
        CPU kernels' ``mask_rows`` for grammar masks (None: torch ops)."""
        self.argmax = argmax if argmax is not None else _torch_argmax
        self.mask = mask
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        """``logits``: [num_rows, vocab] (any float dtype, any device)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        if not rows:
            return SampleOutput([], [])
        if logits.device.type != "cpu":
            ids = device_greedy(logits, rows)
            if ids is not None:
                return SampleOutput(ids, [None] * len(rows))
        # [S, V]; copied only when something will modify it in place (the caller's is not ours)
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        penalised = any(_has_penalties(r) for r in rows)
        logits = logits.to("cpu", torch.float32, copy=penalised or bool(biased or constrained))
        for i in biased:
            bias = rows[i].params.logit_bias_ids()
            logits[i, torch.tensor(list(bias))] += torch.tensor(list(bias.values()))
        if constrained:
            mask_rows(logits, constrained, [rows[i].matcher for i in constrained], self.mask)
        if penalised:
            self._apply_penalties(logits, rows)
        out_ids = [0] * len(rows)

        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):  # the common case: no row gather
            out_ids = [int(t) for t in self.argmax(logits).tolist()]
        elif greedy:
            idx = torch.tensor(greedy)
            for i, t in zip(greedy, self.argmax(logits.index_select(0, idx)).tolist(), strict=True):
                out_ids[i] = t
        sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if sampled:
            tokens = self._sample(
                logits.index_select(0, torch.tensor(sampled)), [rows[i] for i in sampled]
            )
            for i, t in zip(sampled, tokens, strict=True):
                out_ids[i] = t

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits.index_select(0, torch.tensor(want)), dim=-1)  # [W, V]
            for j, i in enumerate(want):
                n = rows[i].params.logprobs or 0
                top_lp, top_ids = lp[j].topk(n) if n else (torch.empty(0), torch.empty(0))
                logprobs[i] = TokenLogprobs(
                    token_id=out_ids[i],
                    logprob=float(lp[j, out_ids[i]]),
                    top_ids=[int(x) for x in top_ids.tolist()],
                    top_logprobs=[float(x) for x in top_lp.tolist()],
                )
        return SampleOutput(out_ids, logprobs)

    @staticmethod
    def skip(params: SamplingParams, generator: torch.Generator | None, vocab: int) -> None:
        """Advance ``generator`` exactly as sampling one row of ``vocab`` logits with
        ``params`` would. The decode side of a KV handoff calls this for the first token, which
        the prefill worker sampled from the same seed: the rest of the draws then match an
        aggregated run."""
        if generator is not None and not _is_greedy(params):
            torch.empty(vocab).exponential_(generator=generator)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0 and r.token_ids:
                ids = torch.tensor(sorted(set(r.token_ids)))
                seen = logits[i, ids]
                logits[i, ids] = torch.where(
                    seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty
                )
            if (p.frequency_penalty or p.presence_penalty) and r.output_counts:
                ids = torch.tensor(list(r.output_counts))
                counts = torch.tensor(list(r.output_counts.values()), dtype=logits.dtype)
                logits[i, ids] -= p.frequency_penalty * counts + p.presence_penalty

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """``logits``: [S, V] of non-greedy rows → one token id per row."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(0 < k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)  # [S, V]
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine).
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return [int(t) for t in self.argmax(probs / noise).tolist()]


def device_greedy(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int] | None:
    """Token ids of a batch whose every row is plain greedy (no bias, grammar, penalties or
    log-probs), taken where the logits are: one arg-max and one copy of ``S`` ids back,
    instead of ``[S, vocab]`` logits. None when any row needs the full sampler."""
    if not all(_is_greedy(r.params) for r in rows):
        return None
    if any(
        r.params.logit_bias or r.matcher is not None or r.params.logprobs is not None for r in rows
    ) or any(_has_penalties(r) for r in rows):
        return None
    return [int(t) for t in logits.argmax(dim=-1).tolist()]


def _has_penalties(r: SamplingRow) -> bool:
    """Whether :meth:`Sampler._apply_penalties` changes this row's logits."""
    p = r.params
    return bool(
        (p.repetition_penalty != 1.0 and r.token_ids)
        or ((p.frequency_penalty or p.presence_penalty) and r.output_counts)
    )


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0.0 or p.top_k == 1


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. [S, V] → [S, V]."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k])
    ranks = torch.arange(vocab).unsqueeze(0)  # [1, V]
    remove = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before*
    # it already reaches top_p (so the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    # top_p 1.0 keeps everything (a cumulative sum may round to 1.0 before the tail).
    thresholds = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=probs.dtype)
    remove |= before >= thresholds.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
