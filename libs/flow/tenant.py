"""Who a request is served as: its tenant, weight and band (docs/flow-control.md).

The tenant is the team the request bills as (a NATS team account, or the team of the API key
it came with), else its API key, else the fleet itself (internal clients on the fleet's own
account). The weight and the cap on the band come from the tenant's entry: the teams file for
a team (the router writes them on the request, ``services/router/teams.py``), the key's row
for a key (the gateway writes them), defaults otherwise. Every queue of the fleet — the
router's holds, a worker's engine — reads them from the request through these functions.
"""

from __future__ import annotations

from libs.engine.params import PRIORITY_BANDS, Priority, Tenant
from libs.protocol import GenerateRequest

FLEET_TENANT = "fleet"


def tenant_of(req: GenerateRequest) -> str:
    """``team:<name>``, ``key:<id>``, or ``fleet``."""
    if req.team:
        return f"team:{req.team}"
    if req.api_key_id:
        return f"key:{req.api_key_id}"
    return FLEET_TENANT


def engine_tenant(req: GenerateRequest) -> Tenant:
    """What a worker hands its engine (or fake backend) with the request."""
    return Tenant(tenant_of(req), req.tenant_weight or 1.0)


def capped(requested: Priority, allowed: Priority | None) -> Priority:
    """``requested``, or the tenant's best allowed band when it asks for a better one."""
    if allowed is None:
        return requested
    return max(requested, allowed, key=PRIORITY_BANDS.index)
