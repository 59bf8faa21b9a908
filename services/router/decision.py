"""The router's decision for one request, as ``Router.decide`` returns it: the pool it chose
(``PoolChoice``, with the pools it may spill to), the ranked workers of that pool
(``Decision``; its ``route`` is the ``RouteReason`` every placement records), or why there is
none (``Rejection``: the typed error the request's stream ends with).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.protocol import ErrorCode, RouteReason
from services.router.placement import Placement
from services.router.regions import Regions

# Workers offered one decision before the router gives up with no_capacity.
MAX_OFFERS = 4


@dataclass
class PoolChoice:
    pool: str
    code: str  # explicit_pool | explicit_model | explicit_adapter | auto_small | auto_large | auto_single_pool
    score: float | None = None
    factors: list[str] = field(default_factory=list)
    # Pools the request may run in, preferred first (spill-over targets after ``pool``).
    allowed: list[str] = field(default_factory=list)


@dataclass
class Decision:
    pool: str
    code: str
    score: float | None
    factors: list[str]
    ranked: list[Placement]
    decide_s: float = 0.0
    # Disaggregated pool (the ranked workers are prefill workers): decode workers, best first.
    decode_workers: list[str] = field(default_factory=list)
    # Why the request leaves the router's region ("" while a local worker can take it) and
    # the router's view of the regions (regions.py).
    cross: str = ""
    regions: Regions | None = None

    def route(self, p: Placement) -> RouteReason:
        factors = [*self.factors, f"load={p.load_cost:.3f}", f"prefill={p.prefill_cost:.3f}"]
        crossing = self.regions.crossing(p, self.cross) if self.regions is not None else ""
        if crossing:
            factors.append(f"cross_region={p.region_cost:.3f}")
        if self.code == "explicit_adapter":  # the LoRA adapter loaded there, or its cost
            factors.append(
                f"adapter_miss={p.adapter_cost:.3f}" if p.adapter_cost else "adapter=loaded"
            )
        return RouteReason(
            pool=self.pool,
            worker_id=p.worker.worker_id,
            code=self.code,
            score=self.score,
            factors=factors,
            overlap_blocks=p.overlap_blocks,
            cost=round(p.cost, 4),
            region=p.worker.beat.region,
            cross_region=crossing,
        )


@dataclass
class Rejection:
    code: ErrorCode
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    # no_worker: the pools that had none (a worker coming to one of them is waited for).
    pools: list[str] = field(default_factory=list)


def span_attributes(route: RouteReason) -> dict[str, str | int | float | list[str]]:
    """A placement's attributes on the router's spans (``router.route``, ``router.migrate``)."""
    attrs: dict[str, str | int | float | list[str]] = {
        "strait.pool": route.pool,
        "strait.worker_id": route.worker_id,
        "strait.route_reason": route.code,
        "strait.route_factors": route.factors,
        "strait.overlap_blocks": route.overlap_blocks,
    }
    if route.score is not None:
        attrs["strait.difficulty"] = route.score
    if route.cost is not None:
        attrs["strait.route_cost"] = route.cost
    if route.region:
        attrs["strait.region"] = route.region
    if route.cross_region:
        attrs["strait.cross_region"] = route.cross_region
    return attrs
