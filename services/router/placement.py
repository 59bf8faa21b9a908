"""Placement inside a pool: the worker with the lowest cost.

    cost(w) = overlap_weight * uncached_prompt_tokens(w) / prefill_norm_tokens
            + load_weight    * (running + waiting + pending) / capacity
            [+ router.adapter_miss_cost when the request's LoRA adapter is not loaded on w]

The first term is the prefill work the worker would still have to do (the prompt's leading
blocks it already holds, from its KV events, are free); ``prefill_norm_tokens`` says how many
uncached prompt tokens weigh as much as one fully loaded worker. The second is its decode load
from its last beat, plus the assignments this router made since (``pending``), so a burst does
not pile onto the worker whose beat looked idle. As in Dynamo's KV router, a long shared prefix
pulls a request to the worker that holds it until that worker is loaded enough to outweigh it.

A worker of another region than the router's carries a crossing cost on top
(``router.cross_region_cost``, per region ``router.region_costs``; ``extra``): the router
decides which workers compete (its own region's first, docs/regions.md), and the crossing cost
orders the regions among themselves and against a saturated local one.

A request naming a LoRA adapter (docs/engine.md "LoRA adapters") costs
``router.adapter_miss_cost`` more on a worker whose beats do not list it as loaded
(``WorkerBeat.adapters``; ``adapter`` here): that worker reads it from disk first and may evict
another adapter. Weighed with load and prefix overlap in the same sum, a worker holding the
adapter wins until it is loaded that much more than one without.

Costs within ``tie_epsilon`` of the best are ties, and one of them is chosen at random: several
router replicas with the same view (and no knowledge of each other's pending work) then spread
a burst over the equally good workers instead of herding onto the first one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from libs.registry import WorkerView, held_load


@dataclass(slots=True)
class CostWeights:
    overlap_weight: float = 1.0
    load_weight: float = 1.0
    prefill_norm_tokens: int = 1024
    tie_epsilon: float = 0.05


@dataclass(slots=True)
class Placement:
    worker: WorkerView
    cost: float
    overlap_blocks: int
    prefill_cost: float
    load_cost: float
    region_cost: float = 0.0
    adapter_cost: float = 0.0  # router.adapter_miss_cost when its adapter is not loaded here


def worker_cost(
    view: WorkerView,
    prompt_tokens: int,
    overlap_blocks: int,
    w: CostWeights,
    extra: float = 0.0,
    adapter: float = 0.0,
) -> Placement:
    cached = min(overlap_blocks * view.beat.block_size, prompt_tokens)
    prefill = w.overlap_weight * (prompt_tokens - cached) / max(w.prefill_norm_tokens, 1)
    load = w.load_weight * view.load
    cost = prefill + load + extra + adapter
    return Placement(view, cost, overlap_blocks, prefill, load, extra, adapter)


def rank(
    workers: list[WorkerView],
    prompt_tokens: int,
    overlaps: dict[str, int],
    weights: CostWeights,
    rng: random.Random,
    top: int = 4,
    extra: dict[str, float] | None = None,
    adapter: dict[str, float] | None = None,
) -> list[Placement]:
    """The ``top`` best workers, best first: a random one of the near-best, then by cost.
    ``extra``: worker id → cost added to it (the crossing cost of another region's);
    ``adapter``: worker id → the adapter miss cost of a worker without the request's adapter."""
    if not workers:
        return []
    # NOTE: the hot loop of a decision (every live worker of the pool); kept to plain tuples,
    # Placement objects are built for the few that can be offered.
    prefill_per_token = weights.overlap_weight / max(weights.prefill_norm_tokens, 1)
    scored = []
    for i, v in enumerate(workers):
        b = v.beat
        cached = min(overlaps.get(b.worker_id, 0) * b.block_size, prompt_tokens)
        load = weights.load_weight * held_load(b, len(v.pending_at))
        cost = prefill_per_token * (prompt_tokens - cached) + load
        if extra:
            cost += extra.get(b.worker_id, 0.0)
        if adapter:
            cost += adapter.get(b.worker_id, 0.0)
        scored.append((cost, i))
    scored.sort()
    best = scored[0][0]
    n_ties = 1
    while n_ties < len(scored) and scored[n_ties][0] - best <= weights.tie_epsilon:
        n_ties += 1
    if n_ties > 1:
        pick = rng.randrange(n_ties)
        scored[0], scored[pick] = scored[pick], scored[0]
    extra = extra or {}
    adapter = adapter or {}
    return [
        worker_cost(
            workers[i],
            prompt_tokens,
            overlaps.get(workers[i].worker_id, 0),
            weights,
            extra.get(workers[i].worker_id, 0.0),
            adapter.get(workers[i].worker_id, 0.0),
        )
        for _, i in scored[:top]
    ]
