"""Flow control in the router (docs/flow-control.md): who each request is served as, the order
its pool's held requests leave in, and the bounds a tenant meets while it waits.

``Router`` owns one ``TenantFlow``; ``Holds.hold_while_full`` calls ``arrive`` for a new
request, ``bypass`` (a tenant with fewer than ``flow.min_in_flight`` requests in the pool is not
held), ``over_share`` and ``expired`` while it waits, and ``order`` to rank the held line;
``Router.place`` calls ``placed`` when the request leaves for a worker; the stream watch's end
(or ``place`` itself for a request it does not watch) calls ``ended``. Each pool has its own
fair share (libs/engine/fair.py): a placement charges the request's prompt and ``max_tokens`` as
an estimate, corrected to the output it streamed when it ends. State is per request in flight
or held, bounded by the router's own bounds (``router.max_pool_queue``, ``router.max_watched``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from libs.engine.fair import FairShare
from libs.flow.tenant import tenant_of
from libs.protocol import Finished, GenerateRequest
from libs.settings import Settings
from services.router import metrics
from services.router.classifier import CHARS_PER_TOKEN, prompt_text
from services.router.decision import Rejection


@dataclass
class _Entry:
    pool: str
    tenant: str
    held: bool = True
    output_estimate: int = 0  # output tokens charged at placement


class TenantFlow:
    def __init__(self, settings: Settings) -> None:
        self.cfg = settings.flow
        self.retry_after_s = settings.fleet.retry_after_s
        self.prompt_cost = settings.engine.fair_prompt_token_cost
        self.shares: dict[str, FairShare] = {}
        self.entries: dict[str, _Entry] = {}  # request key → where it is
        self.in_flight: dict[tuple[str, str], int] = {}  # (pool, tenant) → placed, not ended
        self.held: dict[tuple[str, str], int] = {}  # (pool, tenant) → held now
        # A request whose end is never seen (an exception between placement and its watch)
        # must not stay counted for ever: past this many, the oldest entry ends as unseen.
        self.max_entries = 2 * (settings.router.max_watched + settings.router.max_pool_queue)

    def share(self, pool: str) -> FairShare:
        if pool not in self.shares:
            self.shares[pool] = FairShare(prompt_cost=self.prompt_cost)
        return self.shares[pool]

    def arrive(self, req: GenerateRequest, pool: str) -> str:
        """Count ``req`` active in ``pool``'s share (once per request key); its tenant."""
        e = self.entries.get(req.key)
        if e is None:
            while len(self.entries) >= self.max_entries:
                self._end(self.entries.pop(next(iter(self.entries))), None)
            e = self.entries[req.key] = _Entry(pool, tenant_of(req))
            self.share(pool).enter(e.tenant, req.tenant_weight or 1.0)
        return e.tenant

    def describe(self, req: GenerateRequest) -> tuple[str, float | None]:
        """``req``'s tenant and its counter in its pool (None: not in flow control)."""
        e = self.entries.get(req.key)
        if e is None:
            return tenant_of(req), None
        return e.tenant, self.share(e.pool).counter(e.tenant)

    def pool_of(self, req: GenerateRequest) -> str:
        e = self.entries.get(req.key)
        return "" if e is None else e.pool

    def bypass(self, pool: str, tenant: str) -> bool:
        """The tenant has fewer than ``flow.min_in_flight`` requests in the pool: not held."""
        return self.in_flight.get((pool, tenant), 0) < self.cfg.min_in_flight

    def hold(self, pool: str, tenant: str, delta: int) -> None:
        k = (pool, tenant)
        self.held[k] = self.held.get(k, 0) + delta
        metrics.TENANT_HELD.labels(pool=pool, tenant=metrics.tenant_label(tenant)).inc(delta)

    def over_share(self, req: GenerateRequest, pool: str, tenant: str) -> Rejection | None:
        """The tenant already has its bound of requests held in ``pool``: over_share."""
        bound = req.tenant_max_waiting
        if bound is None:
            bound = self.cfg.max_waiting
        held = self.held.get((pool, tenant), 0)
        if held < bound:
            return None
        setting = "the tenant's max_waiting" if req.tenant_max_waiting else "flow.max_waiting"
        return Rejection(
            "over_share",
            f"{tenant} already has {held} requests waiting for pool {pool!r} ({setting}="
            f"{bound}); retry after the Retry-After interval",
            retry_after_s=self.retry_after_s,
        )

    def expired(self, req: GenerateRequest) -> Rejection | None:
        """``req`` has waited past its queue deadline: deadline_exceeded."""
        timeout = req.queue_timeout_s or self.cfg.queue_timeout_s
        waited = time.time() - req.created_at
        if waited < timeout:
            return None
        setting = "queue_timeout_s" if req.queue_timeout_s else "flow.queue_timeout_s"
        return Rejection(
            "deadline_exceeded",
            f"the request waited {waited:.1f} s for a worker, past its deadline ({setting}="
            f"{timeout:g})",
        )

    def order(self, pool: str, tenant: str, band: int, since: float) -> tuple[int, float, float]:
        return self.share(pool).key(band, tenant, since)

    def placed(self, req: GenerateRequest) -> float:
        """``req`` leaves for a worker: in flight, charged its estimate. Its tenant's counter."""
        e = self.entries.get(req.key)
        if e is None or not e.held:
            return 0.0 if e is None else self.share(e.pool).counter(e.tenant)
        e.held = False
        k = (e.pool, e.tenant)
        self.in_flight[k] = self.in_flight.get(k, 0) + 1
        e.output_estimate = req.sampling.max_tokens * req.sampling.n
        share = self.share(e.pool)
        prompt = len(prompt_text(req)) // CHARS_PER_TOKEN
        share.charge(e.tenant, prompt_tokens=prompt, output_tokens=e.output_estimate)
        return share.counter(e.tenant)

    def ended(self, req: GenerateRequest, final: Finished | None) -> None:
        """``req``'s stream ended (or it was answered without one): the output estimate is
        corrected to what it streamed, and the tenant leaves the share if it was its last."""
        e = self.entries.pop(req.key, None)
        if e is not None:
            self._end(e, final)

    def _end(self, e: _Entry, final: Finished | None) -> None:
        share = self.share(e.pool)
        if not e.held:
            k = (e.pool, e.tenant)
            self.in_flight[k] -= 1
            if not self.in_flight[k]:
                del self.in_flight[k]
            used = final.usage.completion_tokens if final is not None else e.output_estimate
            share.charge(e.tenant, output_tokens=used - e.output_estimate)
            label = metrics.tenant_label(e.tenant)
            metrics.TENANT_TOKENS.labels(pool=e.pool, tenant=label).inc(used)
        share.leave(e.tenant)
