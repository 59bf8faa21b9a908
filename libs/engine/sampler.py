"""Turns the logits of the rows that sample this step into tokens (and log-probabilities).

Called by the engine once per step with one logits row per sampled position and one
:class:`SamplingRow` per row (a row of a prompt's last token appears ``n`` times when the
request forks into ``n`` choices). Order of processing per row, as in the OpenAI/HF APIs:

0. ``logit_bias`` added, then the grammar's mask (rows whose sequence has a matcher: tokens the
   grammar does not allow next get -inf; see ``libs.engine.structured``);
1. penalties: repetition (HF semantics: prompt + output tokens, divide positive logits /
   multiply negative ones), then frequency and presence (OpenAI: output tokens only);
2. log-probabilities, when asked, from the penalised logits before temperature;
3. greedy (temperature 0 or top-k 1): arg-max; otherwise temperature, top-k, top-p, min-p, and
   a draw by the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``), where ``E`` comes
   from the row's own ``torch.Generator`` when the request has a seed — so a seeded request
   draws the same numbers whatever else is in the batch.

Every step runs where the logits are (decision 0018): on a GPU the bias, grammar mask,
penalties, sampling and log-probabilities are device ops and the step's token ids come back in
one copy (plus the asked log-probabilities), never ``[S, vocab]`` logits. Only the inputs that
live on the host travel the other way: bias and penalty ids, the grammar's bitmask
(``[S, vocab / 32]`` int32), and a seeded row's noise, drawn from its own CPU generator and
copied, so a seeded request draws the same numbers on any device. On a CPU the same code runs
with Strait's kernels for the arg-max and the grammar mask where the engine has them.
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
        self._device_generators: dict[torch.device, torch.Generator] = {}
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
        dev = logits.device
        on_host = dev.type == "cpu"
        if not on_host:
            ids = device_greedy(logits, rows)
            if ids is not None:
                return SampleOutput(ids, [None] * len(rows))
        # Strait's CPU kernels serve CPU tensors only; elsewhere torch's ops.
        argmax = self.argmax if on_host else _torch_argmax
        # [S, V]; copied only when something will modify it in place (the caller's is not ours)
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        penalised = any(_has_penalties(r) for r in rows)
        logits = logits.to(torch.float32, copy=penalised or bool(biased or constrained))
        for i in biased:
            bias = rows[i].params.logit_bias_ids()
            ids_ = torch.tensor(list(bias), device=dev)
            logits[i, ids_] += torch.tensor(list(bias.values()), device=dev)
        if constrained:
            matchers = [rows[i].matcher for i in constrained]
            mask_rows(logits, constrained, matchers, self.mask if on_host else None)
        if penalised:
            self._apply_penalties(logits, rows)

        # [S] token ids, filled where the logits are; one copy back below.
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):  # the common case: no row gather
            out = argmax(logits)
        else:
            out = torch.empty(len(rows), dtype=torch.long, device=dev)
        if greedy and len(greedy) < len(rows):
            idx = torch.tensor(greedy, device=dev)
            out.index_copy_(0, idx, argmax(logits.index_select(0, idx)))
        sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if sampled:
            idx = torch.tensor(sampled, device=dev)
            drawn = self._sample(logits.index_select(0, idx), [rows[i] for i in sampled], argmax)
            out.index_copy_(0, idx, drawn)
        out_ids = [int(t) for t in out.tolist()]

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=dev)
            lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)  # [W, V]
            chosen = lp.gather(1, out.index_select(0, idx).unsqueeze(1)).squeeze(1)  # [W]
            n_max = max(rows[i].params.logprobs or 0 for i in want)
            # The widest top-n of the rows, taken once; each row keeps its own first n. One
            # copy back of [W] + 2 x [W, n_max].
            top_lp, top_ids = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
            chosen_l, top_lp_l, top_ids_l = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                n = rows[i].params.logprobs or 0
                logprobs[i] = TokenLogprobs(
                    token_id=out_ids[i],
                    logprob=float(chosen_l[j]),
                    top_ids=[int(x) for x in top_ids_l[j][:n]],
                    top_logprobs=[float(x) for x in top_lp_l[j][:n]],
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
        dev = logits.device
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0 and r.token_ids:
                ids = torch.tensor(sorted(set(r.token_ids)), device=dev)
                seen = logits[i, ids]
                logits[i, ids] = torch.where(
                    seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty
                )
            if (p.frequency_penalty or p.presence_penalty) and r.output_counts:
                ids = torch.tensor(list(r.output_counts), device=dev)
                counts = torch.tensor(
                    list(r.output_counts.values()), dtype=logits.dtype, device=dev
                )
                logits[i, ids] -= p.frequency_penalty * counts + p.presence_penalty

    def _sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        argmax: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``logits``: [S, V] of non-greedy rows → one token id per row, ``[S]`` int64 on the
        logits' device."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(0 < k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)  # [S, V]
        min_ps = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_ps):
            min_p = torch.tensor(min_ps, dtype=probs.dtype, device=dev)
            floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine).
        noise = torch.empty_like(probs)
        vocab = probs.shape[1]
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            idx = torch.tensor(shared, device=dev)
            draw = torch.empty(len(shared), vocab, device=dev)
            noise.index_copy_(0, idx, draw.exponential_(generator=self._shared_generator(dev)))
        for i, r in enumerate(rows):
            if r.generator is not None:
                # Drawn on the host from the request's own generator (see the module's doc).
                noise[i].copy_(torch.empty(vocab).exponential_(generator=r.generator))
        return argmax(probs / noise)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from on ``device``: the sampler's own on a CPU, one
        per other device, seeded from it once."""
        if device.type == "cpu":
            return self.generator
        gen = self._device_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
            gen.manual_seed(seed)
            self._device_generators[device] = gen
        return gen


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
    vocab, dev = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=dev)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
    remove = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass *before*
    # it already reaches top_p (so the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    # top_p 1.0 keeps everything (a cumulative sum may round to 1.0 before the tail).
    thresholds = torch.tensor(
        [p if p < 1.0 else float("inf") for p in top_p], dtype=probs.dtype, device=dev
    )
    remove |= before >= thresholds.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
