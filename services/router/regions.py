"""Placement across regions: which workers compete for a request, and at what crossing cost.

A router is in one region (``nats.region``, its NATS cluster); the beats of every region's
workers reach it through the supercluster's gateways, so its registry holds them all. For a
request of a pool:

- while a live worker of the pool in the router's region is below ``router.saturation_load``,
  only the local workers compete (ranked as in ``placement``); the other regions' workers
  follow them in the offer list, so a local worker that does not answer (dead within its beat
  TTL) hands over to another region at once;
- otherwise (none live here, or all saturated) every region's workers compete, each remote
  one with its region's crossing cost added (``router.region_costs``, else
  ``router.cross_region_cost``): the nearest, least loaded region wins, a saturated local
  worker still wins over a remote one more loaded than it by the crossing cost.

A worker's held KV blocks count for that worker alone (``WorkerRegistry.overlaps``), and a
remote worker competes only once the local ones cannot take the request: blocks held in
another region never pull a request out of its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from libs.registry import WorkerView
from services.router.placement import CostWeights, Placement, rank

NO_LOCAL_WORKER = "no_local_worker"
LOCAL_SATURATED = "local_saturated"
LOCAL_UNANSWERED = "local_unanswered"  # offered after the local workers refused or were silent


@dataclass
class Regions:
    region: str  # the router's ("": no regions: every worker is local)
    cross_cost: float = 1.0
    costs: dict[str, float] = field(default_factory=dict)
    saturation_load: float = 1.0

    def local(self, w: WorkerView) -> bool:
        """A worker of the router's region (one announcing no region counts as local)."""
        return not self.region or not w.beat.region or w.beat.region == self.region

    def cost(self, region: str) -> float:
        """The crossing cost to ``region`` (0 for the router's own)."""
        if not self.region or not region or region == self.region:
            return 0.0
        return self.costs.get(region, self.cross_cost)

    def rank(
        self,
        workers: list[WorkerView],
        prompt_tokens: int,
        overlaps: dict[str, int],
        weights: CostWeights,
        rng: random.Random,
        top: int,
        adapter: dict[str, float] | None = None,
    ) -> tuple[list[Placement], str]:
        """The workers to offer the request to, best first, and why it leaves the region
        ("" while a local worker can take it: NO_LOCAL_WORKER, LOCAL_SATURATED). ``adapter``:
        the LoRA adapter miss cost of each worker without the request's adapter."""
        local = [w for w in workers if self.local(w)]
        remote = [w for w in workers if not self.local(w)]
        if not remote:
            return rank(local, prompt_tokens, overlaps, weights, rng, top, None, adapter), ""
        extra = {w.worker_id: self.cost(w.beat.region) for w in remote}
        if local and min(w.load for w in local) < self.saturation_load:
            first = rank(local, prompt_tokens, overlaps, weights, rng, top, None, adapter)
            rest = rank(
                remote, prompt_tokens, overlaps, weights, rng, top - len(first), extra, adapter
            )
            return first + rest, ""
        why = LOCAL_SATURATED if local else NO_LOCAL_WORKER
        return rank(workers, prompt_tokens, overlaps, weights, rng, top, extra, adapter), why

    def crossing(self, p: Placement, why: str) -> str:
        """``RouteReason.cross_region`` of a placement: "" for a local worker."""
        if self.local(p.worker):
            return ""
        return why or LOCAL_UNANSWERED
