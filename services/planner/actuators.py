"""Actuators: what turns a ``PlanDecision`` into running workers. One interface, two kinds.

- ``LocalActuator``: inside ``strait up``'s supervisor (services/supervisor/). It subscribes
  to the planner's decisions on a thread of its own and hands each fresh one to the fleet's
  ``scale(pool, role, replicas, reason, drain_order)``, which starts workers or drains the
  surplus, the decision's ``drain_order`` first (SIGTERM or SIGUSR2: the worker's own drain,
  so nothing running is dropped).
- ``KubernetesActuator``: inside the planner (``planner.actuator = "kubernetes"``); sets the
  ``replicas`` of each pool role's Deployment through the scale subresource with the
  ``kubernetes`` client (decision 0019), the pods ranked for a scale-down by the decision's
  ``drain_order``. Pod termination is the same drain.

Both ignore decisions older than ``planner.decision_max_age_s`` and do nothing when no decision
comes: a planner that dies leaves the fleet the size it was (advisory-safe).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nats.aio.msg import Msg

from libs.log import fields
from libs.protocol import PlanDecision, Subjects, WorkerStarting
from libs.settings import Settings

log = logging.getLogger("strait.planner.actuator")


class Actuator(Protocol):
    def apply(self, decision: PlanDecision) -> None:
        """Make the pool role's worker count ``decision.replicas`` (idempotent)."""


def fresh(decision: PlanDecision, max_age_s: float, now: float | None = None) -> bool:
    return (time.time() if now is None else now) - decision.ts <= max_age_s


# ---------------------------------------------------------------- local (strait up)


class WorkerSet(Protocol):
    """What the local actuator drives: the supervisor's fleet."""

    def scale(
        self, pool: str, role: str, replicas: int, reason: str, drain_order: Sequence[str] = ()
    ) -> None: ...

    def standby_loaded(self, worker_id: str, pid: int) -> None:
        """The standby ``worker_id`` (process ``pid``) has loaded and waits to be activated."""


class LocalActuator:
    """Applies decisions to ``strait up``'s children. ``apply`` is called on the supervisor's
    own thread (``poll``); the NATS subscription runs on a daemon thread and only queues."""

    def __init__(self, settings: Settings, fleet: WorkerSet) -> None:
        self.settings = settings
        self.fleet = fleet
        self._latest: dict[tuple[str, str], PlanDecision] = {}
        # Standbys heard saying they have loaded since the last poll: worker id → pid.
        self._loaded: dict[str, int] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connected = threading.Event()
        # Set when a decision arrives: the supervisor's loop wakes for it (``wait``).
        self._arrived = threading.Event()

    def apply(self, decision: PlanDecision) -> None:
        if not fresh(decision, self.settings.planner.decision_max_age_s):
            log.info("stale plan ignored", extra=fields(pool=decision.pool, role=decision.role))
            return
        self.fleet.scale(
            decision.pool, decision.role, decision.replicas, decision.reason, decision.drain_order
        )

    def poll(self) -> None:
        """Pass on the standbys that said they have loaded, then apply the newest decision
        received for each pool role since the last poll (on the supervisor's thread)."""
        with self._lock:
            batch, self._latest = list(self._latest.values()), {}
            loaded, self._loaded = self._loaded, {}
        for worker_id, pid in loaded.items():
            self.fleet.standby_loaded(worker_id, pid)
        for d in batch:
            self.apply(d)

    def wait(self, timeout_s: float) -> None:
        """Block the supervisor's loop until a decision arrives or ``timeout_s`` passes: a
        scale-up is applied as it comes, not at the loop's next turn."""
        self._arrived.wait(timeout_s)
        self._arrived.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plan-listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.run(self._listen())

    async def _listen(self) -> None:
        from libs.wire.nats_util import connect
        from services.endpoint import Endpoint, logs

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        nc = await connect(self.settings.nats, "supervisor-plans")
        subjects = Subjects.of(self.settings.nats)

        async def on_plan(d: PlanDecision, msg: Msg) -> None:
            with self._lock:
                self._latest[(d.pool, d.role)] = d
            self._arrived.set()

        async def on_starting(ann: WorkerStarting, msg: Msg) -> None:
            if ann.stage == "standby":
                with self._lock:
                    self._loaded[ann.worker_id] = ann.pid

        plans = Endpoint("supervisor.plan", PlanDecision, on_plan, logs(log, "bad plan"))
        await plans.subscribe(nc, subjects.plans_all)
        starting = Endpoint(
            "supervisor.starting", WorkerStarting, on_starting, logs(log, "bad announcement")
        )
        await starting.subscribe(nc, subjects.starting_all)
        await nc.flush()
        self.connected.set()
        try:
            await self._stop.wait()
        finally:
            await nc.close()


# ---------------------------------------------------------------- Kubernetes


# The ReplicaSet controller removes the pods with the lowest value first on a scale-down.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class KubernetesActuator:
    """Sets Deployment replicas through ``apps/v1 deployments/scale`` (decision 0019).

    ``api`` is a ``kubernetes.client.AppsV1Api``, ``core`` a ``CoreV1Api`` (in-cluster config
    by default). Each role of a pool maps to one Deployment (``planner.kubernetes_deployment``
    / ``kubernetes_prefill_deployment`` with ``{pool}``); a decode role of a disaggregated pool
    is the pool's worker Deployment. A replicas value already in place is not written again.
    Before a scale-down it ranks the pods by the decision's ``drain_order`` (a worker's id is
    its pod's name) in their ``pod-deletion-cost``: the ReplicaSet removes the worker whose
    drain ends soonest, not one it picks. A failed ranking (no RBAC for pods) is logged and
    the scale-down goes on in the ReplicaSet's own order.
    """

    def __init__(self, settings: Settings, api: Any = None, core: Any = None) -> None:
        self.cfg = settings.planner
        if api is None or core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = api or client.AppsV1Api()
            core = core or client.CoreV1Api()
        self.api = api
        self.core = core
        self._applied: dict[str, int] = {}

    def deployment(self, pool: str, role: str) -> str:
        template = (
            self.cfg.kubernetes_prefill_deployment
            if role == "prefill"
            else self.cfg.kubernetes_deployment
        )
        return template.format(pool=pool)

    def apply(self, decision: PlanDecision) -> None:
        if not fresh(decision, self.cfg.decision_max_age_s):
            return
        name = self.deployment(decision.pool, decision.role)
        ns = self.cfg.kubernetes_namespace
        scale = self.api.read_namespaced_deployment_scale(name, ns)
        now = int(scale.spec.replicas or 0)
        if now == decision.replicas:
            self._applied[name] = now
            return
        if decision.replicas < now and decision.drain_order:
            self.rank_pods(decision.drain_order, ns)
        self.api.patch_namespaced_deployment_scale(
            name, ns, {"spec": {"replicas": decision.replicas}}
        )
        self._applied[name] = decision.replicas
        log.info(
            "deployment scaled",
            extra=fields(
                deployment=name,
                namespace=ns,
                replicas_from=now,
                replicas=decision.replicas,
                reason=decision.reason,
            ),
        )

    def rank_pods(self, drain_order: list[str], ns: str) -> None:
        """Deletion cost 1, 2, ... in ``drain_order``: the first goes first. Pods not in it
        (starting, not beating yet, so idle) keep the default 0 and go before them."""
        for cost, pod in enumerate(drain_order, start=1):
            body = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
            try:
                self.core.patch_namespaced_pod(pod, ns, body)
            except Exception as e:  # ApiException (403 without the Role's pods rule, 404 gone)
                log.warning(
                    "pod deletion cost not set", extra=fields(pod=pod, namespace=ns, error=repr(e))
                )
                return


def build_actuator(settings: Settings) -> Callable[[PlanDecision], None] | None:
    """The in-planner actuator (``kubernetes``), or None (``local`` applies in the supervisor,
    ``none`` nowhere)."""
    if settings.planner.actuator == "kubernetes":
        return KubernetesActuator(settings).apply
    return None
