"""The Kubernetes actuator through the real `kubernetes` client against a RECORDED API: the
HTTP layer (urllib3's pool manager) is replaced by one that answers with Scale and Pod objects
written from the Kubernetes API reference (autoscaling/v1 Scale, core/v1 Pod), not captured from
a cluster. Checks the requests the actuator makes: method, path, patch body and content type."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import urllib3

from libs.protocol import PlanDecision
from libs.settings import Settings
from services.planner.actuators import KubernetesActuator

pytestmark = pytest.mark.unit

kubernetes = pytest.importorskip("kubernetes")


def recorded_scale(name: str, replicas: int) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": "strait", "resourceVersion": "4711"},
        "spec": {"replicas": replicas},
        "status": {
            "replicas": replicas,
            "selector": "app.kubernetes.io/component=worker,app.kubernetes.io/name=strait",
        },
    }


def recorded_pod(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "strait", "annotations": annotations},
        "spec": {"containers": [{"name": "worker", "image": "strait"}]},
        "status": {"phase": "Running"},
    }


@dataclass
class RecordedApi:
    """Answers GET and PATCH of deployments/scale like an API server holding ``replicas``, and
    PATCH of pods' annotations (``annotations``); ``forbid_pods``: a 403 for pods, as a Role
    without the pods rule gets."""

    replicas: dict[str, int]
    calls: list[tuple[str, str, dict[str, Any] | None, str]] = field(default_factory=list)
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    forbid_pods: bool = False

    def request(self, method: str, url: str, **kw: Any) -> urllib3.HTTPResponse:
        path = urllib3.util.parse_url(url).path or ""
        body = kw.get("body")
        patch = json.loads(body) if body else None
        ctype = (kw.get("headers") or {}).get("Content-Type", "")
        self.calls.append((method, path, patch, ctype))
        if "/pods/" in path:
            name = path.split("/pods/")[1]
            if self.forbid_pods:
                return answer({"kind": "Status", "code": 403, "reason": "Forbidden"}, 403)
            assert patch is not None
            self.annotations.setdefault(name, {}).update(patch["metadata"]["annotations"])
            return answer(recorded_pod(name, self.annotations[name]))
        name = path.split("/deployments/")[1].split("/")[0]
        if method == "PATCH" and patch is not None:
            self.replicas[name] = patch["spec"]["replicas"]
        return answer(recorded_scale(name, self.replicas[name]))


def answer(obj: dict[str, Any], status: int = 200) -> urllib3.HTTPResponse:
    return urllib3.HTTPResponse(
        body=json.dumps(obj).encode(),
        status=status,
        headers={"Content-Type": "application/json"},
        preload_content=True,
    )


def actuator(api: RecordedApi) -> KubernetesActuator:
    cfg = kubernetes.client.Configuration()
    cfg.host = "https://kubernetes.default.svc"
    client = kubernetes.client.ApiClient(cfg)
    client.rest_client.pool_manager = api
    return KubernetesActuator(
        Settings(), kubernetes.client.AppsV1Api(client), kubernetes.client.CoreV1Api(client)
    )


def decision(pool: str, role: str, replicas: int, **kw: Any) -> PlanDecision:
    return PlanDecision(pool=pool, role=role, replicas=replicas, reason="scale_up", **kw)  # type: ignore[arg-type]


def test_a_decision_patches_the_pools_deployment_scale() -> None:
    api = RecordedApi({"strait-worker-default": 1})
    actuator(api).apply(decision("default", "aggregated", 3))
    base = "/apis/apps/v1/namespaces/strait/deployments/strait-worker-default/scale"
    assert [(m, p) for m, p, _, _ in api.calls] == [("GET", base), ("PATCH", base)]
    _, _, body, ctype = api.calls[1]
    assert body == {"spec": {"replicas": 3}}
    assert ctype in (
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
        "application/json-patch+json",
    )
    assert api.replicas["strait-worker-default"] == 3


def test_prefill_role_scales_the_prefill_deployment_and_no_write_when_in_place() -> None:
    api = RecordedApi({"strait-prefill-disagg": 2, "strait-worker-disagg": 2})
    act = actuator(api)
    act.apply(decision("disagg", "prefill", 2))
    act.apply(decision("disagg", "decode", 2))
    assert [m for m, *_ in api.calls] == ["GET", "GET"]  # both already there
    assert "strait-prefill-disagg" in api.calls[0][1]
    assert "strait-worker-disagg" in api.calls[1][1]


def test_a_stale_decision_changes_nothing() -> None:
    api = RecordedApi({"strait-worker-default": 2})
    actuator(api).apply(decision("default", "aggregated", 0, ts=time.time() - 3600))
    assert api.calls == [] and api.replicas["strait-worker-default"] == 2


def test_a_scale_down_ranks_the_pods_by_the_decisions_drain_order_first() -> None:
    # Three workers, two wanted: the pods get deletion costs 1, 2, 3 in drain_order (the
    # ReplicaSet removes the lowest: the worker with the fewest requests), then the scale.
    api = RecordedApi({"strait-worker-default": 3})
    order = ["strait-worker-default-b", "strait-worker-default-c", "strait-worker-default-a"]
    actuator(api).apply(decision("default", "aggregated", 2, drain_order=order))
    pods = "/api/v1/namespaces/strait/pods/"
    scale = "/apis/apps/v1/namespaces/strait/deployments/strait-worker-default/scale"
    assert [(m, p) for m, p, _, _ in api.calls] == [
        ("GET", scale),
        *[("PATCH", pods + name) for name in order],
        ("PATCH", scale),
    ]
    cost = "controller.kubernetes.io/pod-deletion-cost"
    assert {n: a[cost] for n, a in api.annotations.items()} == {
        order[0]: "1",
        order[1]: "2",
        order[2]: "3",
    }
    assert api.replicas["strait-worker-default"] == 2


def test_no_ranking_on_a_scale_up_and_a_forbidden_ranking_does_not_stop_the_scale_down() -> None:
    api = RecordedApi({"strait-worker-default": 2})
    actuator(api).apply(decision("default", "aggregated", 3, drain_order=["x", "y"]))
    assert not any("/pods/" in p for _, p, _, _ in api.calls)  # up: nothing to rank
    denied = RecordedApi({"strait-worker-default": 3}, forbid_pods=True)
    actuator(denied).apply(decision("default", "aggregated", 1, drain_order=["x", "y", "z"]))
    # One refused patch (the Role lacks the pods rule) ends the ranking; the scale goes on.
    assert [p.rsplit("/", 1)[-1] for m, p, _, _ in denied.calls if "/pods/" in p] == ["x"]
    assert denied.replicas["strait-worker-default"] == 1
