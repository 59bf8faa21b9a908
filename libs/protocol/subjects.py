"""Every NATS subject of the fleet, built from one prefix: :class:`Subjects`.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

from typing import Any, Literal

from libs.protocol.base import valid_team


class Subjects:
    """Every subject name, built from one prefix. Wildcards are for subscribers.

    With a ``region`` (``nats.region``, docs/regions.md) the subjects JetStream stores and the
    prefix-cache service's are the region's own, ``<prefix>.region.<region>.…``: each region's
    requests, events and cache live in its own cluster's streams, and its prefix cache answers
    its own workers. Every other subject (beats, work, streams, cancels) is one name for the
    whole supercluster and crosses the gateways."""

    def __init__(self, prefix: str = "strait.v1", region: str = "") -> None:
        self.prefix = prefix
        self.region = region
        self.regional = f"{prefix}.region.{region}" if region else prefix

    @classmethod
    def of(cls, nats: Any) -> Subjects:
        """The subjects of a process configured by ``nats`` (``NatsSettings``: its prefix and
        region)."""
        return cls(nats.subject_prefix, nats.region)

    @property
    def requests(self) -> str:
        return f"{self.regional}.requests"

    @property
    def team_requests_all(self) -> str:
        """Every team's requests subject (the requests stream takes these and ``requests``)."""
        return f"{self.prefix}.requests.*"

    def stream(self, request_id: str) -> str:
        return f"{self.prefix}.stream.{request_id}"

    # A process of the fleet's account that reads many streams (a gateway, a StraitClient)
    # names ``reply.<reader>.<request_id>`` as the ``reply_subject`` of the requests it submits
    # and reads them all through one subscription to ``reply.<reader>.*`` (no SUB/UNSUB and
    # server round trip per request, no subscription task per stream).
    def reply_stream(self, reader: str, request_id: str) -> str:
        return f"{self.prefix}.reply.{reader}.{request_id}"

    def reply_streams(self, reader: str) -> str:
        return f"{self.prefix}.reply.{reader}.*"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.cancel.{request_id}"

    def cancel_key(self, key: str) -> str:
        """Where the fleet cancels the request of ``key`` (``GenerateRequest.key``): a team's
        request on the subject its team's own cancel arrives on, ``cancel.<team>.<id>``."""
        return f"{self.prefix}.cancel.{key}"

    @property
    def cancel_all(self) -> str:
        """The fleet's cancels and the teams' (``cancel.<team>.<request_id>``)."""
        return f"{self.prefix}.cancel.>"

    def resend(self, request_id: str) -> str:
        return f"{self.prefix}.resend.{request_id}"

    @property
    def resend_all(self) -> str:
        return f"{self.prefix}.resend.>"

    # A team's account (docs/security.md) imports the fleet's ``requests.<team>`` as its own
    # ``requests``, ``cancel.<team>.*`` / ``resend.<team>.*`` as ``cancel.*`` / ``resend.*``,
    # and ``stream.<team>.*`` as ``stream.*``: a team's client uses the plain names, and the
    # fleet reads the sender's team from the subject, which the server wrote, not the sender.

    def team_requests(self, team: str) -> str:
        return f"{self.prefix}.requests.{team}"

    def team_stream(self, team: str, request_id: str) -> str:
        return f"{self.prefix}.stream.{team}.{request_id}"

    def team_of(self, subject: str, kind: Literal["requests", "cancel", "resend"]) -> str | None:
        """The team token of a team's ``requests``/``cancel``/``resend`` subject; None for the
        fleet's own (``requests``, ``cancel.<id>``, ``resend.<id>``). Raises ValueError for a
        subject of neither shape."""
        head = f"{self.prefix}.{kind}"
        if subject == head and kind == "requests":
            return None
        if not subject.startswith(head + "."):
            raise ValueError(f"not a {kind} subject: {subject!r}")
        tokens = subject[len(head) + 1 :].split(".")
        own = 0 if kind == "requests" else 1  # tokens a fleet subject has after the head
        if len(tokens) == own:
            return None
        if len(tokens) == own + 1 and valid_team(tokens[0]):
            return tokens[0]
        raise ValueError(f"not a {kind} subject: {subject!r}")

    def addressed(
        self, subject: str, kind: Literal["cancel", "resend"], named: str = ""
    ) -> tuple[str | None, str]:
        """(team, request id) a cancel or resend is for. A team's names its request in the
        subject (its import wrote ``<kind>.<team>.<id>``); the fleet's may name it in the
        message instead (``named``). Raises ValueError for a subject of neither shape."""
        team = self.team_of(subject, kind)
        rid = subject.rsplit(".", 1)[-1]
        return team, (named or rid) if team is None else rid

    @property
    def teams_changed(self) -> str:
        return f"{self.prefix}.admin.teams"

    def work(self, worker_id: str) -> str:
        return f"{self.prefix}.work.{worker_id}"

    def beat(self, pool: str, role: str, worker_id: str) -> str:
        return f"{self.prefix}.workers.{pool}.{role}.{worker_id}"

    @property
    def beats_all(self) -> str:
        return f"{self.prefix}.workers.>"

    def starting(self, pool: str, role: str, worker_id: str) -> str:
        return f"{self.prefix}.starting.{pool}.{role}.{worker_id}"

    @property
    def starting_all(self) -> str:
        return f"{self.prefix}.starting.>"

    def router_beat(self, router_id: str) -> str:
        return f"{self.prefix}.routers.{router_id}"

    @property
    def router_beats_all(self) -> str:
        return f"{self.prefix}.routers.*"

    def kv_events(self, worker_id: str) -> str:
        return f"{self.prefix}.kv_events.{worker_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv_events.*"

    def event(self, kind: Literal["usage", "route"]) -> str:
        return f"{self.regional}.events.{kind}"

    @property
    def worker_usage(self) -> str:
        """Workers' own UsageEvent of each finished request (source "worker"), for the ledger."""
        return f"{self.regional}.events.usage.worker"

    @property
    def events_all(self) -> str:
        return f"{self.regional}.events.>"

    def batch(self, batch_id: str) -> str:
        """The lines of one batch (``BatchLine``; purged by subject when it is cancelled)."""
        return f"{self.prefix}.batch.{batch_id}"

    @property
    def batch_all(self) -> str:
        return f"{self.prefix}.batch.*"

    def handoff_offer(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.offer"

    def handoff_commit(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.commit"

    def handoff_abort(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.abort"

    def handoff_kv(self, worker_id: str, transfer_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.kv.{transfer_id}"

    def handoff_kv_all(self, worker_id: str) -> str:
        return f"{self.prefix}.handoff.{worker_id}.kv.*"

    def drain(self, worker_id: str) -> str:
        return f"{self.prefix}.admin.drain.{worker_id}"

    def adapters(self, pool: str) -> str:
        """``AdapterCommand`` to every worker of ``pool``."""
        return f"{self.prefix}.admin.adapters.{pool}"

    @property
    def stream_owner(self) -> str:
        return f"{self.prefix}.handoff.owner"

    def plan(self, pool: str, role: str) -> str:
        return f"{self.prefix}.planner.decision.{pool}.{role}"

    @property
    def plans_all(self) -> str:
        return f"{self.prefix}.planner.decision.>"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def cache_lookup(self) -> str:
        return f"{self.regional}.cache.lookup"

    @property
    def cache_fetch(self) -> str:
        return f"{self.regional}.cache.fetch"

    @property
    def cache_store(self) -> str:
        return f"{self.regional}.cache.store"

    @property
    def cache_events(self) -> str:
        return f"{self.regional}.cache.events"
