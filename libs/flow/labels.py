"""Bounded label values for per-tenant metrics: the first ``limit`` tenants a process sees keep
their own value, later ones count as ``other`` (``flow.max_tenant_labels``). Used by the
router's and the workers' metrics."""

from __future__ import annotations

OTHER = "other"


class TenantLabels:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.known:
            return tenant
        if len(self.known) < self.limit:
            self.known.add(tenant)
            return tenant
        return OTHER
