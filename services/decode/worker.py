"""The decode worker of a disaggregated pool (``worker.role = "decode"``).

Its requests arrive prefilled: a prefill worker offers one over the handoff subjects
(``services.decode.handoff.HandoffReceiver``), the KV blocks are imported into this engine's
prefix cache, and :meth:`DecodeWorker.serve_handoff` generates from the handed-off first token,
continuing the stream at ``HandoffOffer.next_seq``. An assignment sent to it directly (the router
sends none: it places a disaggregated pool's requests on prefill workers) runs as on an
aggregated worker, except a migration, which must go through a prefill worker.
"""

from __future__ import annotations

from opentelemetry.context import Context

from libs.protocol import Assignment, HandoffOffer
from services.worker.aggregated import AggregatedWorker, Start


class DecodeWorker(AggregatedWorker):
    def refusal(self, a: Assignment) -> str:
        if reason := super().refusal(a):
            return reason
        return "migration_unsupported" if a.migration is not None else ""

    async def serve_handoff(self, offer: HandoffOffer, parent: Context) -> None:
        """Run a committed handoff's request to its end (its task: ``HandoffReceiver``)."""
        await self.generate(offer.assignment, parent, Start.handed_off(offer))
