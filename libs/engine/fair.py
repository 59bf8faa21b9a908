"""Weighted fair share of tokens served, after the virtual token counter (VTC).

Who calls it: the engine's scheduler (libs/engine/scheduler.py) orders its waiting queue and
picks whom to preempt by it and charges every token it runs; the router
(services/router/holds.py) orders the requests it holds and charges what it places; the fake
backend (libs/backend/fake.py) seats its requests by it.

Each tenant has a counter: tokens served to it divided by its weight, a prompt token at
``prompt_cost`` and an output token at ``output_cost`` (the unit). Among waiting requests the
next is the oldest of the tenant with the lowest counter, inside the best priority band. A
tenant becomes active with its first request waiting or running and leaves with its last; on
becoming active again its counter is lifted to the lowest counter of the active tenants, so
idle time saves no credit, and leaving erases no debt (a closed-loop client is idle for a
moment between requests). The counters of idle tenants are kept for the ``max_idle`` most
recent ones (a tenant forgotten past that starts at the floor).
A lone tenant is served whenever there is room: the order decides only who goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_IDLE_TENANTS = 10_000


@dataclass
class FairShare:
    prompt_cost: float = 1.0  # output-token units per prompt token computed
    output_cost: float = 1.0
    counters: dict[str, float] = field(default_factory=dict)  # active tenants only
    weights: dict[str, float] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)  # tenant → requests waiting or running
    idle: OrderedDict[str, float] = field(default_factory=OrderedDict)  # counters, oldest first
    max_idle: int = MAX_IDLE_TENANTS

    def enter(self, tenant: str, weight: float = 1.0) -> None:
        """A request of ``tenant`` starts waiting (or running): count it active."""
        n = self.active.get(tenant, 0)
        if n == 0:
            self.counters[tenant] = max(self.idle.pop(tenant, 0.0), self.floor())
        self.active[tenant] = n + 1
        self.weights[tenant] = max(weight, 1e-6)

    def leave(self, tenant: str) -> None:
        """A request of ``tenant`` ended (finished, failed, cancelled or moved away)."""
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
            return
        self.active.pop(tenant, None)
        self.weights.pop(tenant, None)
        counter = self.counters.pop(tenant, None)
        if counter is not None:
            self.idle[tenant] = counter
            while len(self.idle) > self.max_idle:
                self.idle.popitem(last=False)

    def floor(self) -> float:
        """The lowest counter of the active tenants (0 with none)."""
        return min(self.counters.values(), default=0.0)

    def charge(self, tenant: str, prompt_tokens: float = 0, output_tokens: float = 0) -> None:
        """Count tokens served to an active ``tenant`` (negative amounts correct an estimate)."""
        if tenant not in self.counters:
            return
        cost = prompt_tokens * self.prompt_cost + output_tokens * self.output_cost
        self.counters[tenant] += cost / self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, self.floor())

    def share(self, tenant: str) -> float:
        """``tenant``'s weight over the active tenants' total (its fair fraction, 0..1)."""
        total = sum(self.weights.values())
        return self.weights.get(tenant, 0.0) / total if total else 1.0

    def key(self, band: int, tenant: str, arrival: float) -> tuple[int, float, float]:
        """Sort key of a waiting request: band, its tenant's counter, then arrival."""
        return (band, self.counter(tenant), arrival)
