"""deploy/k8s/overlays/planner as kustomize renders it (decision 0019): the planner Deployment
runs a real subcommand with real settings and the Kubernetes actuator, probes its own port,
may only get and patch deployments/scale and patch pods (their deletion cost) in its namespace,
finds every pool role's Deployment
by the names its settings build, and is the only thing scaling them (no ScaledObject)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.planner.actuators import KubernetesActuator
from services.planner.planner import roles_of
from tests.unit.deploy.test_deploy_config import (
    K8S,
    VALUE_FROM_PLACEHOLDER,
    assert_real_subcommand,
    by_kind,
    container_env,
    effective_settings,
    kustomize,
    settings_field_exists,
    strait_containers,
)

pytestmark = pytest.mark.unit


def test_planner_overlay(tmp_path: Path) -> None:
    docs = kustomize(K8S / "overlays" / "planner")
    containers = {c.role: c for c in strait_containers(docs)}
    planner = containers["planner"]
    assert_real_subcommand(planner.spec["args"], planner.where)
    env = container_env(planner, docs, tmp_path)
    assert all(settings_field_exists(v) for v in env if v.startswith("STRAIT_")), env
    s = effective_settings(env)
    assert s.planner.actuator == "kubernetes"
    assert env["STRAIT_PLANNER__KUBERNETES_NAMESPACE"] == VALUE_FROM_PLACEHOLDER  # the pod's
    port = s.planner.metrics_port
    assert port and s.telemetry.http_host == "0.0.0.0"
    assert planner.spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert planner.spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert planner.workload["spec"]["replicas"] == 1  # one writer of the replicas

    # RBAC: the pod's ServiceAccount is bound to a Role of exactly deployments/scale get+patch
    # and pods patch (the deletion cost that picks a scale-down's pod).
    account = planner.pod["spec"]["serviceAccountName"]
    ns = planner.workload["metadata"]["namespace"]
    assert any(a["metadata"]["name"] == account for a in by_kind(docs, "ServiceAccount"))
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": ns}]
    (role,) = [
        r for r in by_kind(docs, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    assert role["metadata"]["namespace"] == ns
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
    ]

    # Every pool role's Deployment exists under the name the actuator builds, with no
    # replicas of its own and no ScaledObject: the planner alone sets its count.
    actuator = KubernetesActuator(s, api=object(), core=object())
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    assert not by_kind(docs, "ScaledObject")
    for pool in s.pools:
        for r in roles_of(pool):
            name = actuator.deployment(pool.name, r)
            assert name in deployments, (pool.name, r)
            assert "replicas" not in deployments[name]["spec"], name
