from __future__ import annotations

import pytest
import torch

from libs.engine.sampler import Sampler, SamplingRow
from libs.protocol import SamplingParams

pytestmark = pytest.mark.unit

V = 50


def row(
    seed: int | None = None,
    ids: tuple[int, ...] = (),
    counts: dict[int, int] | None = None,
    **params: object,
) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), gen, list(ids), counts or {})  # type: ignore[arg-type]


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_are_argmax() -> None:
    lg = logits(2)
    out = Sampler(0)(lg, [row(temperature=0.0), row(temperature=1.0, top_k=1)])
    assert out.token_ids == lg.argmax(-1).tolist()


def test_a_given_argmax_serves_greedy_and_seeded_rows_alike() -> None:
    """The engine hands the sampler the CPU kernels' arg-max; every pick goes through it and
    the tokens are those of torch's."""
    calls: list[tuple[int, ...]] = []

    def recording_argmax(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x.argmax(dim=-1)

    lg = logits(3, seed=4)
    rows = [row(temperature=0.0), row(seed=7, temperature=0.8), row(temperature=0.0)]
    got = Sampler(0, argmax=recording_argmax)(lg, rows)
    assert calls == [(2, V), (1, V)]  # the greedy rows, then the sampled row's race
    rows[1] = row(seed=7, temperature=0.8)  # a fresh generator: the same draw again
    assert got.token_ids == Sampler(0)(lg, rows).token_ids


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    lg = logits()
    order = lg[0].argsort(descending=True).tolist()
    probs = torch.softmax(lg[0], -1)
    sampler = Sampler(0)
    draws = {
        name: {sampler(lg, [row(seed=s, **p)]).token_ids[0] for s in range(200)}
        for name, p in {
            "k3": dict(top_k=3),
            "p": dict(top_p=0.5),
            "minp": dict(min_p=0.3),
        }.items()
    }
    assert draws["k3"] <= set(order[:3]) and len(draws["k3"]) > 1
    nucleus = []
    for t in order:  # smallest prefix with mass >= 0.5
        nucleus.append(t)
        if probs[nucleus].sum() >= 0.5:
            break
    assert draws["p"] <= set(nucleus)
    assert draws["minp"] <= {t for t in range(V) if probs[t] >= 0.3 * probs.max()}


def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch() -> None:
    lg = logits(4)
    alone = [Sampler(1)(lg[2:3], [row(seed=42, temperature=0.9)]).token_ids[0] for _ in range(1)]
    rows = [row(temperature=1.0), row(seed=7), row(seed=42, temperature=0.9), row()]
    batched = Sampler(2)(lg, rows).token_ids[2]
    assert alone[0] == batched
    # Same seed → same sequence of draws; different seed → (almost surely) different draws.
    seq = lambda s: [Sampler()(lg[:1], [row(seed=s)]).token_ids[0] for _ in range(1)]  # noqa: E731
    assert seq(3) == seq(3)
    g = torch.Generator().manual_seed(5)
    r = SamplingRow(SamplingParams(), g, [], {})
    draws_a = [Sampler()(lg[:1], [r]).token_ids[0] for _ in range(20)]
    g.manual_seed(5)
    draws_b = [Sampler()(lg[:1], [r]).token_ids[0] for _ in range(20)]
    assert draws_a == draws_b and len(set(draws_a)) > 1


def test_penalties_push_repeated_tokens_down() -> None:
    lg = torch.zeros(1, V)
    lg[0, 3] = 2.0
    lg[0, 4] = 1.9
    greedy = dict(temperature=0.0)
    assert Sampler()(lg, [row(**greedy)]).token_ids == [3]
    assert Sampler()(lg, [row(ids=(3,), repetition_penalty=1.2, **greedy)]).token_ids == [4]
    assert Sampler()(lg, [row(counts={3: 1}, presence_penalty=0.5, **greedy)]).token_ids == [4]
    assert Sampler()(lg, [row(counts={3: 2}, frequency_penalty=0.1, **greedy)]).token_ids == [4]
    assert Sampler()(lg, [row(counts={3: 1}, frequency_penalty=0.05, **greedy)]).token_ids == [3]


def test_logprobs_of_sampled_token_and_top_alternatives() -> None:
    lg = logits()
    out = Sampler()(lg, [row(temperature=0.0, logprobs=3)])
    lp = out.logprobs[0]
    assert lp is not None
    ref = torch.log_softmax(lg[0], -1)
    assert lp.token_id == out.token_ids[0] == lp.top_ids[0]
    assert lp.logprob == pytest.approx(float(ref.max()))
    assert lp.top_ids == ref.topk(3).indices.tolist()
    assert Sampler()(lg, [row()]).logprobs == [None]
