"""Seats for requests served at once, handed out in fair-share order: the fake backend's
admission (libs/backend/fake.py), by the same rules as the engine's scheduler
(libs/engine/scheduler.py): a tenant with no request seated goes first in its band, into up
to ``headroom`` seats beyond ``seats``; otherwise the oldest request of the tenant with the
lowest counter in the best band, while a seat is free. No preemption."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from libs.engine.fair import FairShare


@dataclass(eq=False)
class _Waiter:
    band: int
    arrival: int
    tenant: str
    future: asyncio.Future[None]


@dataclass
class FairGate:
    seats: int
    headroom: int = 0
    fair: FairShare = field(default_factory=FairShare)
    seated: dict[str, int] = field(default_factory=dict)
    waiting: list[_Waiter] = field(default_factory=list)
    _arrivals: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def num_seated(self) -> int:
        return sum(self.seated.values())

    async def acquire(self, tenant: str, weight: float = 1.0, band: int = 0) -> None:
        """Wait for a seat; the caller calls ``release(tenant)`` when its request ends."""
        self.fair.enter(tenant, weight)
        w = _Waiter(band, next(self._arrivals), tenant, asyncio.get_running_loop().create_future())
        self.waiting.append(w)
        self._grant()
        try:
            await w.future
        except BaseException:
            if w in self.waiting:
                self.waiting.remove(w)
                self.fair.leave(tenant)
            else:  # seated as it was cancelled
                self.release(tenant)
            raise

    def release(self, tenant: str) -> None:
        self.seated[tenant] -= 1
        if not self.seated[tenant]:
            del self.seated[tenant]
        self.fair.leave(tenant)
        self._grant()

    def _order(self, w: _Waiter) -> tuple[int, float, int]:
        return (w.band, self.fair.counter(w.tenant), w.arrival)

    def _next(self) -> _Waiter | None:
        live = [w for w in self.waiting if not w.future.done()]
        head = min(live, key=self._order, default=None)
        if head is None:
            return None
        n = self.num_seated
        unseated = [w for w in live if w.tenant not in self.seated and w.band <= head.band]
        if unseated and n < self.seats + self.headroom:
            return min(unseated, key=self._order)
        return head if n < self.seats else None

    def _grant(self) -> None:
        while (w := self._next()) is not None:
            self.waiting.remove(w)
            self.seated[w.tenant] = self.seated.get(w.tenant, 0) + 1
            w.future.set_result(None)
