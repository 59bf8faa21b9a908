"""The deployment files checked against the code (no Docker engine or cluster needed).

docker-compose.yml (with its "disaggregated" profile), deploy/k8s (raw base, and base /
overlays / components as kustomize renders them when ``kubectl`` is on PATH), deploy/prometheus,
deploy/grafana, deploy/nats, Dockerfile:

- every Strait container runs a real ``strait`` subcommand (``services.cli._parser()``);
- every ``STRAIT_*`` variable is a real settings field (walks ``libs.settings.Settings``);
- each container's *effective* settings (its env + the strait.toml its ``STRAIT_CONFIG`` points
  at, through the ConfigMap mount) listen on the ports its probes, Services, scrape annotations,
  compose healthchecks and Prometheus targets use;
- KEDA triggers name the real requests stream and the router's durable consumer;
- a disaggregated pool has prefill and decode workers (each with a budget and a ScaledObject)
  and, with ``cache.enabled``, exactly one cache service;
- the dashboard's PromQL uses only metric names the services register.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from pydantic import BaseModel

from libs.settings import CacheSettings, NatsSettings, Settings
from libs.wire.nats_util import stream_configs
from services.cache.main import DRAIN_TIMEOUT_S as CACHE_DRAIN_TIMEOUT_S
from services.cli import SERVICES, _parser
from services.router.service import ROUTER_DURABLE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "strait-dashboard.json"

# STRAIT_* names read by the code that are not settings fields.
NON_FIELD_ENV = {"STRAIT_CONFIG", "STRAIT_STATE_DIR", "STRAIT_PARENT_PID"}
# Metrics the dashboard must chart (issue #7; KV handoff and prefix-cache service: issue #6).
REQUIRED_ON_DASHBOARD = {
    "strait_gateway_ttft_seconds_bucket",
    "strait_gateway_e2e_seconds_bucket",
    "strait_router_queue_seconds_bucket",
    "strait_worker_running_requests",
    "strait_worker_waiting_requests",
    "strait_worker_kv_blocks_used",
    "strait_worker_itl_seconds_bucket",
    "strait_router_decisions_total",
    "strait_handoff_total",
    "strait_handoff_bytes_total",
    "strait_handoff_seconds_bucket",
    "strait_cache_queries_total",
    "strait_cache_hits_total",
    "strait_cache_misses_total",
    "strait_cache_bytes",
    "strait_cache_blocks",
    "strait_cache_evictions_total",
    "strait_cache_requests_total",
    "strait_cache_request_seconds_bucket",
    "strait_cache_transfer_bytes_total",
}
# Labels the dashboard must break these down by.
REQUIRED_BREAKDOWNS = {
    "strait_handoff_total": {"side", "outcome"},
    "strait_handoff_bytes_total": {"side"},
    "strait_cache_misses_total": {"reason"},
}
# Stand-ins for values that only exist in a cluster (Secrets, the downward API).
VALUE_FROM_PLACEHOLDER = "from-cluster"
LONG_RUNNING_ROLES = set(SERVICES)
# What a worker process can be: `strait worker` serves the role worker.role names (`strait
# decode` is `strait worker`, `strait prefill` is `strait worker --role prefill`).
WORKER_ROLES = ("aggregated", "decode", "prefill")


def process_role(argv: list[str], env: dict[str, str]) -> str:
    """What a `strait` command line runs: its service, or a worker's role (``--role``, else
    ``STRAIT_WORKER__ROLE``; the settings checks below confirm the process reads the same)."""
    if argv[0] == "prefill":
        return "prefill"
    if argv[0] in ("worker", "decode"):
        if "--role" in argv:
            return argv[argv.index("--role") + 1]
        return env.get("STRAIT_WORKER__ROLE", "aggregated")
    return argv[0]


# ----------------------------------------------------------------------------- helpers


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def settings_field_exists(env_name: str) -> bool:
    """``STRAIT_GATEWAY__PORT`` -> Settings.gateway.port exists (nested models walked)."""
    if env_name in NON_FIELD_ENV:
        return True
    parts = env_name.removeprefix("STRAIT_").lower().split("__")
    model: type[BaseModel] = Settings
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(parts) - 1:
            ann = field.annotation
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                return False
            model = ann
    return True


def effective_settings(env: dict[str, str]) -> Settings:
    """The settings a process with exactly this environment would load."""
    env = dict(env)
    # The image's WORKDIR is the repository root, so the default config path is the same.
    env.setdefault("STRAIT_CONFIG", str(ROOT / "configs" / "strait.toml"))
    with mock.patch.dict(os.environ, env, clear=True):
        return Settings()


def listen_port(role: str, s: Settings) -> int | None:
    """The port a role serves /health, /ready and /metrics on (None: role has no port yet)."""
    if role == "gateway":
        return s.gateway.port
    if role == "router":
        return s.router.metrics_port
    if role in WORKER_ROLES:
        return s.worker.metrics_port
    if role == "cache":
        return s.cache.metrics_port
    return None


# Seconds each long-running role drains for on SIGTERM (its pods' grace period must exceed it).
# A worker drains for worker.drain_timeout_s; then its unfinished requests migrate once the
# router's TTL passes without its beats.
_WORKER_DRAIN_S = Settings().worker.drain_timeout_s + Settings().fleet.worker_ttl_s
DRAIN_S = {
    "aggregated": _WORKER_DRAIN_S,
    "decode": _WORKER_DRAIN_S,
    "prefill": _WORKER_DRAIN_S,  # the prefill main drains through run_worker
    "cache": CACHE_DRAIN_TIMEOUT_S,
}


def assert_real_subcommand(argv: list[str], where: str) -> None:
    try:
        _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `strait {' '.join(argv)}` is not a strait subcommand")


def exposed_metric_names() -> set[str]:
    """Sample names the services' registered metrics expose (``_total``, ``_bucket``, ...)."""
    from prometheus_client import REGISTRY

    for path in sorted([*ROOT.glob("services/*/metrics.py"), *ROOT.glob("libs/**/metrics.py")]):
        importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
    from services.cache.metrics import StoreCollector
    from services.cache.store import BlockStore

    # The cache service registers its store's collector only while it serves (services/cache/
    # main.py): collect one over an empty store for the names.
    store_families = StoreCollector(BlockStore(CacheSettings())).collect()
    names: set[str] = set()
    for family in [*REGISTRY.collect(), *store_families]:
        names |= sample_names(family.name, family.type)
    return names


def sample_names(name: str, kind: str) -> set[str]:
    if kind == "counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "histogram":
        return {f"{name}_{s}" for s in ("bucket", "sum", "count", "created")}
    return {name}


def promql_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bstrait_[a-z0-9_]+\b", expr))


# ------------------------------------------------------------------- Kubernetes objects


@dataclass
class Container:
    workload: dict[str, Any]  # the Deployment / StatefulSet
    spec: dict[str, Any]  # the container

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]

    @property
    def role(self) -> str:
        env = {e["name"]: str(e.get("value", "")) for e in self.spec.get("env", [])}
        return process_role(self.spec["args"], env)

    @property
    def where(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}"


def base_docs() -> list[dict[str, Any]]:
    """deploy/k8s/base as written: its resources plus the ConfigMaps its generators make."""
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = [d for r in kust["resources"] for d in load_yaml_docs(K8S / "base" / r)]
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (K8S / "base" / f).read_text() for f in gen.get("files", [])}
        data |= dict(lit.split("=", 1) for lit in gen.get("literals", []))
        docs.append({"kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return docs


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH: kustomize renderings not checked")
    out = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def gpu_with_ttft(tmp: Path) -> Path:
    """An overlay composing overlays/gpu with the optional TTFT autoscaling component."""

    def rel(p: Path) -> str:  # kustomize refuses absolute paths to other kustomizations
        return os.path.relpath(p, tmp)

    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [rel(K8S / "overlays" / "gpu")],
                "components": [rel(K8S / "components" / "ttft-autoscaling")],
            }
        )
    )
    return tmp


VARIANTS = [
    "base-raw", "base", "gpu", "gpu+ttft", "disagg", "gpu+disagg", "secure", "region-a", "region-b"
]  # fmt: skip
OVERLAYS = {
    "base": K8S / "base",
    "region-a": K8S / "overlays" / "region-a",
    "region-b": K8S / "overlays" / "region-b",
    "secure": K8S / "overlays" / "secure",
    "gpu": K8S / "overlays" / "gpu",
    "disagg": K8S / "overlays" / "disaggregated",
    "gpu+disagg": K8S / "overlays" / "gpu-disaggregated",
}


@pytest.fixture(params=VARIANTS)
def k8s(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    name = request.param
    if name == "base-raw":
        return name, base_docs()
    return name, kustomize(OVERLAYS.get(name) or gpu_with_ttft(tmp_path))


def strait_containers(docs: list[dict[str, Any]]) -> Iterator[Container]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c["image"].split(":")[0].rsplit("/", 1)[-1] == "strait":
                    yield Container(d, c)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container_env(c: Container, docs: list[dict[str, Any]], tmp: Path) -> dict[str, str]:
    """The container's environment; STRAIT_CONFIG re-pointed at the mounted ConfigMap's file."""
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in by_kind(docs, "ConfigMap")}
    env: dict[str, str] = {}
    for src in c.spec.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in configmaps, f"{c.where}: envFrom ConfigMap {ref} does not exist"
        env |= configmaps[ref]
    for e in c.spec.get("env", []):
        env[e["name"]] = str(e["value"]) if "value" in e else VALUE_FROM_PLACEHOLDER
    if "STRAIT_CONFIG" in env:
        cfg = Path(env["STRAIT_CONFIG"])
        mount = next(
            (m for m in c.spec.get("volumeMounts", []) if Path(m["mountPath"]) == cfg.parent), None
        )
        assert mount, f"{c.where}: nothing is mounted at {cfg.parent} (STRAIT_CONFIG={cfg})"
        volume = next(v for v in c.pod["spec"]["volumes"] if v["name"] == mount["name"])
        data = configmaps[volume["configMap"]["name"]]
        assert cfg.name in data, f"{c.where}: ConfigMap has no {cfg.name} (STRAIT_CONFIG={cfg})"
        local = tmp / f"{c.workload['metadata']['name']}-{cfg.name}"
        local.write_text(data[cfg.name])
        env["STRAIT_CONFIG"] = str(local)
    return env


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------- compose


def compose() -> dict[str, Any]:
    """docker-compose.yml as Compose reads it with no variables set: ``${VAR-default}`` and
    ``${VAR:-default}`` become their defaults."""
    return yaml.safe_load(re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", COMPOSE.read_text()))


def compose_strait_services() -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if str(svc.get("image", "")).split(":")[0] == "strait"
    }


def compose_env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items()}


def healthcheck_url(svc: dict[str, Any]) -> tuple[int, str]:
    test = " ".join(svc["healthcheck"]["test"])
    m = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", test)
    assert m, f"healthcheck does not GET a local URL: {test}"
    return int(m.group(1)), m.group(2)


# =========================================================================== tests


def test_every_deployment_file_parses() -> None:
    yaml_files = [COMPOSE, *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]
    for path in yaml_files:
        assert load_yaml_docs(path) or path.stat().st_size == 0, path
    json.loads(DASHBOARD.read_text())
    for toml in K8S.rglob("*.toml"):
        with mock.patch.dict(os.environ, {"STRAIT_CONFIG": str(toml)}, clear=True):
            Settings()  # validates every value, not only the names


def test_compose_runs_real_subcommands_with_real_settings() -> None:
    services = compose_strait_services()
    roles = {process_role(svc["command"], compose_env(svc)) for svc in services.values()}
    assert {"gateway", "router", "aggregated", "decode", "prefill", "cache"} <= roles
    for name, svc in services.items():
        assert_real_subcommand(svc["command"], f"compose service {name}")
        assert svc["command"][0] in LONG_RUNNING_ROLES
        for var in compose_env(svc):
            if var.startswith("STRAIT_"):
                assert settings_field_exists(var), f"compose {name}: {var} is not a setting"


def test_compose_ports_and_healthchecks_match_the_services() -> None:
    services = compose_strait_services()
    worker_ids = []
    for name, svc in services.items():
        env = compose_env(svc)
        role = process_role(svc["command"], env)
        s = effective_settings(env)
        port = listen_port(role, s)
        assert port, f"compose {name}: role {role} has no HTTP port (0 disables it)"
        published = [int(str(p).split(":")[-1].split("/")[0]) for p in svc.get("ports", [])]
        exposed = [int(str(p)) for p in svc.get("expose", [])]
        assert port in published + exposed, f"compose {name}: listens on {port}"
        hc_port, hc_path = healthcheck_url(svc)
        assert (hc_port, hc_path in ("/health", "/ready")) == (port, True), name
        assert s.nats.url == "nats://nats:4222"
        assert s.database_url.startswith("postgresql+asyncpg://")
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").endswith(":4318")  # OTLP/HTTP
        if role == "gateway":
            assert s.gateway.host == "0.0.0.0", "the gateway must listen beyond loopback"
        else:
            assert s.telemetry.http_host == "0.0.0.0", f"compose {name}: listener on loopback"
        if role in WORKER_ROLES:
            assert s.pool(s.worker.pool), f"compose {name}: pool {s.worker.pool} not configured"
            worker_ids.append(s.worker.worker_id)
    assert all(worker_ids) and len(set(worker_ids)) == len(worker_ids), worker_ids


def test_compose_disaggregated_profile() -> None:
    """Profile "disaggregated": one pool with a prefill and a decode worker of the right roles
    and mode, the cache service, prefill workers with the cache client on; nothing else."""
    services = compose_strait_services()
    profiled = {n: svc for n, svc in services.items() if "disaggregated" in svc.get("profiles", [])}
    assert {process_role(svc["command"], compose_env(svc)) for svc in profiled.values()} == {
        "cache",
        "prefill",
        "decode",
    }
    pools: dict[str, set[str]] = {}
    for name, svc in services.items():
        role = process_role(svc["command"], compose_env(svc))
        s = effective_settings(compose_env(svc))
        if role not in WORKER_ROLES:
            continue
        pool = s.pool(s.worker.pool)
        assert pool, name
        expected = ("prefill", "decode") if pool.mode == "disaggregated" else ("aggregated",)
        assert s.worker.role == role, f"compose {name}: runs {role}, settings say {s.worker.role}"
        assert role in expected, f"compose {name}: role {role} in {pool}"
        assert (name in profiled) == (pool.mode == "disaggregated"), name
        pools.setdefault(pool.name, set()).add(s.worker.role)
        if role == "prefill":
            assert pool.mode == "disaggregated" and s.cache.enabled, name
    disaggregated = [p for p, roles in pools.items() if "prefill" in roles]
    assert disaggregated, "no disaggregated pool in compose"
    for p in disaggregated:
        assert pools[p] == {"prefill", "decode"}, f"pool {p} mixes roles: {pools[p]}"
    assert sum(svc["command"][0] == "cache" for svc in services.values()) == 1


def test_compose_infrastructure() -> None:
    svcs = compose()["services"]
    nats_cmd = svcs["nats"]["command"]
    assert "-js" in nats_cmd and nats_cmd[nats_cmd.index("-m") + 1] == "8222"
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    max_payload = int(re.search(r"^max_payload:\s*(\d+)", conf, re.M).group(1))  # type: ignore[union-attr]
    assert max_payload >= NatsSettings().max_payload
    assert svcs["postgres"]["environment"]["POSTGRES_DB"] == "strait"
    assert {"4317:4317", "4318:4318", "16686:16686"} <= set(svcs["jaeger"]["ports"])
    for svc in svcs.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"compose mounts missing {src}"


def test_prometheus_scrapes_every_compose_service_on_its_port() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    by_host = {t.split(":")[0]: int(t.split(":")[1]) for t in targets}
    for name, svc in compose_strait_services().items():
        s = effective_settings(compose_env(svc))
        role = process_role(svc["command"], compose_env(svc))
        assert by_host.get(name) == listen_port(role, s), f"prometheus target for {name}"
        if role == "gateway":
            assert s.gateway.open_metrics, "gateway /metrics needs a key unless open_metrics"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    grafana = compose()["services"]["grafana"]
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "strait.yml").read_text()
    )
    folder = provider["providers"][0]["options"]["path"]
    assert any(v.endswith(f"{folder}/strait-dashboard.json:ro") for v in grafana["volumes"])


def test_k8s_containers(k8s: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    variant, docs = k8s
    containers = list(strait_containers(docs))
    roles = {"gateway", "router", "aggregated"}
    if "disagg" in variant:  # the pool's workers become its decode side
        roles = {"gateway", "router", "decode", "prefill", "cache"}
    assert {c.role for c in containers} == roles, variant
    pools_seen = set()
    services = by_kind(docs, "Service")
    for c in containers:
        assert_real_subcommand(c.spec["args"], c.where)
        env = container_env(c, docs, tmp_path)
        for var in env:
            if var.startswith("STRAIT_"):
                assert settings_field_exists(var), f"{c.where}: {var} is not a setting"
        s = effective_settings(env)
        port = listen_port(c.role, s)
        assert port, f"{c.where}: role {c.role} has no HTTP port (0 disables it)"
        assert port in [p["containerPort"] for p in c.spec["ports"]], c.where
        assert c.spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}, c.where
        assert c.spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}, c.where
        if "startupProbe" in c.spec:
            assert c.spec["startupProbe"]["httpGet"]["port"] == port, c.where
        assert c.spec["resources"]["requests"], c.where
        ann = c.pod["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            assert ann["prometheus.io/port"] == str(port), c.where
            assert ann["prometheus.io/path"] == "/metrics", c.where
        labels = c.pod["metadata"]["labels"]
        svc = [x for x in services if selects(x["spec"]["selector"], labels)]
        assert svc, f"{c.where}: no Service selects it"
        assert port in [p["targetPort"] for x in svc for p in x["spec"]["ports"]], c.where
        assert s.nats.max_payload <= 8 * 1024 * 1024  # nats-values.yaml's max_payload
        if c.role != "gateway":
            assert s.telemetry.http_host == "0.0.0.0", f"{c.where}: listener on loopback"
        if c.role == "gateway":
            assert s.gateway.host == "0.0.0.0", "the gateway must listen beyond loopback"
            assert s.gateway.open_metrics or ann.get("prometheus.io/scrape") != "true"
        if c.role in DRAIN_S:
            assert c.pod["spec"]["terminationGracePeriodSeconds"] > DRAIN_S[c.role], c.where
        if c.role in WORKER_ROLES:
            assert s.worker.role == c.role, (
                f"{c.where}: runs {c.role}, settings say {s.worker.role}"
            )
            assert s.pool(s.worker.pool), f"{c.where}: pool {s.worker.pool} not in settings"
            assert s.worker.worker_id, f"{c.where}: worker_id unset"
            assert s.engine.kv_cache_bytes > 0 or s.engine.device.startswith("cuda"), (
                f"{c.where}: on CPU the KV fraction reads the node's memory, not the pod's"
            )
            if variant.startswith("gpu"):
                assert s.engine.device == "cuda", c.where
                for kind in ("requests", "limits"):
                    assert int(c.spec["resources"][kind]["nvidia.com/gpu"]) >= 1, c.where
        if c.role == "cache":
            assert s.cache.enabled, c.where
        if variant.startswith("region-"):
            region = variant.removeprefix("region-")
            assert (s.nats.region, s.nats.regions) == (region, ["a", "b"]), c.where
            assert s.gateway.ledger_enabled == (region == "a"), c.where
        # One ConfigMap for every role: they agree on the pools and their modes.
        pools_seen.add(json.dumps([p.model_dump() for p in s.pools], sort_keys=True))
    assert len(pools_seen) == 1, f"{variant}: roles disagree on the pools"


def test_k8s_secure_overlay_gives_every_process_its_credentials(tmp_path: Path) -> None:
    """overlays/secure: TLS URL, the fleet's nkey and the CA from the Secret, the teams file
    from its ConfigMap, each at the path its setting names, in every Strait container."""
    docs = kustomize(K8S / "overlays" / "secure")
    containers = list(strait_containers(docs))
    assert {c.role for c in containers} == {"gateway", "router", "aggregated"}
    for c in containers:
        s = effective_settings(container_env(c, docs, tmp_path))
        assert s.nats.url.startswith("tls://"), c.where
        mounts = {m["mountPath"]: m["name"] for m in c.spec["volumeMounts"]}
        volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
        for path, source in (
            (s.nats.nkey_seed_file, ("secret", "strait-nats-credentials")),
            (s.nats.tls_ca_file, ("secret", "strait-nats-credentials")),
            (s.teams.file, ("configMap", "strait-teams")),
        ):
            vol = volumes[mounts[str(Path(path).parent)]]
            kind, name = source
            assert vol[kind].get("secretName", vol[kind].get("name")) == name, (c.where, path)
    teams = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "strait-teams")
    json.loads(teams["data"]["teams.json"])


def test_k8s_pools_have_workers_budgets_and_autoscaling(
    k8s: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    variant, docs = k8s
    # (pool, role) -> the Deployment's container; role as the process sees it.
    workers: dict[tuple[str, str], Container] = {}
    caches: list[Container] = []
    settings: Settings | None = None
    for c in strait_containers(docs):
        s = effective_settings(container_env(c, docs, tmp_path))
        if c.role in WORKER_ROLES:
            role = s.worker.role
            assert (s.worker.pool, role) not in workers, f"two Deployments for {role} {c.where}"
            workers[(s.worker.pool, role)] = c
        if c.role == "cache":
            caches.append(c)
        settings = s
    assert settings is not None
    expected = set()
    for p in settings.pools:
        roles = ("prefill", "decode") if p.mode == "disaggregated" else ("aggregated",)
        expected |= {(p.name, r) for r in roles}
    assert set(workers) == expected, "one worker Deployment per configured pool and role"
    disaggregated = any(p.mode == "disaggregated" for p in settings.pools)
    # One cache service per fleet (no queue group): never two pods at once, never autoscaled.
    assert len(caches) == (1 if disaggregated and settings.cache.enabled else 0), variant
    for c in caches:
        assert c.workload["spec"]["replicas"] == 1, c.where
        assert c.workload["spec"]["strategy"]["type"] == "Recreate", c.where
    pdbs = by_kind(docs, "PodDisruptionBudget")
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in by_kind(docs, "ScaledObject")}
    assert not {c.workload["metadata"]["name"] for c in caches} & set(scaled), variant
    streams = {c.name for c in stream_configs(NatsSettings())}
    metrics = exposed_metric_names()
    for pod in [c.pod for c in strait_containers(docs)]:
        labels = pod["metadata"]["labels"]
        budgets = [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(budgets) <= 1, (
            f"a pod under two PodDisruptionBudgets cannot be evicted: {labels}"
        )
    for (pool, role), c in workers.items():
        labels = c.pod["metadata"]["labels"]
        assert any(selects(p["spec"]["selector"]["matchLabels"], labels) for p in pdbs), pool
        name = c.workload["metadata"]["name"]
        assert "replicas" not in c.workload["spec"], f"{name}: KEDA owns replicas"
        so = scaled.get(name)
        assert so, f"no ScaledObject scales {name}"
        assert so["spec"]["minReplicaCount"] >= 1, "the router does not wait for a worker"
        kinds = [t["type"] for t in so["spec"]["triggers"]]
        assert "nats-jetstream" in kinds, name
        if variant == "gpu+ttft" and role == "aggregated":
            assert "prometheus" in kinds, name
        for t in so["spec"]["triggers"]:
            meta = t["metadata"]
            if t["type"] == "nats-jetstream":
                assert (
                    meta["stream"] == NatsSettings().requests_stream and meta["stream"] in streams
                )
                assert meta["consumer"] == ROUTER_DURABLE
                assert meta["natsServerMonitoringEndpoint"].endswith(":8222")
            elif t["type"] == "prometheus":
                assert promql_metrics(meta["query"]) <= metrics, meta["query"]


def test_disaggregated_component_config_differs_from_base_only_in_pools_and_cache() -> None:
    """components/disaggregated replaces base/strait.toml: only [cache] and [[pools]] differ."""
    base = tomllib.loads((K8S / "base" / "strait.toml").read_text())
    disagg = tomllib.loads((K8S / "components" / "disaggregated" / "strait.toml").read_text())
    for key in ("cache", "pools"):
        base.pop(key, None)
        disagg.pop(key, None)
    assert disagg == base


def test_nats_helm_values() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())["config"]
    assert values["cluster"]["enabled"] and values["cluster"]["replicas"] == 3
    assert values["jetstream"]["enabled"] and values["jetstream"]["fileStore"]["enabled"]
    assert values["monitor"]["port"] == 8222
    assert values["merge"]["max_payload"] >= NatsSettings().max_payload


def test_dashboard_queries_real_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    used = {m for e in exprs for m in promql_metrics(e)}
    unknown = used - exposed_metric_names()
    assert not unknown, f"dashboard queries metrics nobody registers: {sorted(unknown)}"
    assert REQUIRED_ON_DASHBOARD <= used, sorted(REQUIRED_ON_DASHBOARD - used)
    for metric, labels in REQUIRED_BREAKDOWNS.items():
        by = [
            set(re.findall(r"\w+", m.group(1)))
            for e in exprs
            if metric in promql_metrics(e)
            for m in re.finditer(r"by \(([^)]*)\)", e)
        ]
        assert any(labels <= b for b in by), f"no panel shows {metric} by {sorted(labels)}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dockerfile_builds_the_one_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(
        d for d in pyproject["project"]["optional-dependencies"]["engine"] if d.startswith("torch")
    )
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text, "Dockerfile torch pin drifted"
    assert re.search(r"^ENTRYPOINT \[\"strait\"\]$", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert_real_subcommand(cmd, "Dockerfile CMD")
    assert_real_subcommand(["models", "prepare"], "Dockerfile RUN")
    assert "RUN strait models prepare" in text and "--no-deps" in text
    for var in re.findall(r"\b(STRAIT_[A-Z0-9_]+)=", text):
        assert settings_field_exists(var), f"Dockerfile: {var} is not a setting"
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".strait", "**/__pycache__"} <= ignored
    assert not {"libs", "services", "pyproject.toml"} & ignored


def test_regions_deploy_two_regions_joined_by_a_gateway() -> None:
    """deploy/regions (compose) and deploy/k8s/regions (NATS Helm values): each region's NATS
    cluster and gateway are named after the region its Strait processes are in, every gateway
    names both, and only the ledger's region writes the ledger."""
    regions = DEPLOY / "regions"
    for r in ("a", "b"):
        values = yaml.safe_load((K8S / "regions" / f"nats-values-{r}.yaml").read_text())["config"]
        assert values["cluster"]["merge"]["name"] == r
        gw = values["gateway"]
        assert gw["enabled"] and gw["merge"]["name"] == r
        assert [g["name"] for g in gw["merge"]["gateways"]] == ["a", "b"]
        assert values["serverNamePrefix"] == f"{r}-"
        conf = (regions / f"nats-{r}.conf").read_text()
        assert re.search(rf'cluster \{{\s*name: "{r}"', conf), r
        assert re.search(rf'gateway \{{\s*name: "{r}"', conf), r
        assert 'name: "a", url: "nats://nats-a:7222"' in conf
        assert 'name: "b", url: "nats://nats-b:7222"' in conf
    services = yaml.safe_load((regions / "compose.yml").read_text())["services"]
    strait = {
        n: svc for n, svc in services.items() if str(svc.get("image", "")).startswith("strait")
    }
    assert set(strait) == {f"{role}-{r}" for role in ("router", "worker", "gateway") for r in "ab"}
    for name, svc in strait.items():
        region = name.rsplit("-", 1)[1]
        assert_real_subcommand(svc["command"], name)
        env = compose_env(svc)
        for var in env:
            if var.startswith("STRAIT_"):
                assert settings_field_exists(var), f"{name}: {var} is not a setting"
        s = effective_settings(env)
        assert (s.nats.region, s.nats.regions) == (region, ["a", "b"]), name
        assert s.nats.url == f"nats://nats-{region}:4222", name
        assert s.gateway.ledger_enabled == (region == "a"), name
