"""Flow control between tenants (docs/flow-control.md): what the router and the gateway bound
per tenant. The engine's own part (fair admission, headroom seats, token costs) is in
``engine.fair_*``."""

from __future__ import annotations

from pydantic import Field

from libs.settings.section import Section


class FlowSettings(Section):
    max_waiting: int = Field(default=256, ge=0)
    """Requests of one tenant the router holds for one pool (waiting for room) before it
    answers the next with over_share (HTTP 429 with Retry-After); a team's entry in the teams
    file or a key's `--max-waiting` replaces it for that tenant."""
    queue_timeout_s: float = Field(default=90.0, gt=0)
    """Seconds from a request's creation it may wait in the router for room before it ends with
    deadline_exceeded (HTTP 504); a NATS request's own `queue_timeout_s` replaces it for that
    request. Below `gateway.first_message_timeout_s`, so an HTTP client gets this typed answer
    rather than the gateway's timeout."""
    min_in_flight: int = Field(default=1, ge=0)
    """A tenant with fewer of its requests in flight in a pool than this is never held behind
    other tenants' requests: its next one goes to a worker at once, whose engine seats it in
    its headroom (engine.fair_headroom_seqs). 0: every request waits its turn."""
    max_tenant_labels: int = Field(default=32, ge=1)
    """Tenants that get a label value of their own on per-tenant metrics (the first seen); the
    rest count as `other`."""
