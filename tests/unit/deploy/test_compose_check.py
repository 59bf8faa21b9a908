"""docker-compose.yml for both Composes, the stand-in override and `make compose-check`'s script
(deploy/compose/check.py) checked against each other; no Docker engine needed."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_DIR = ROOT / "deploy" / "compose"
OVERRIDE = COMPOSE_DIR / "standins.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_check", COMPOSE_DIR / "check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", [COMPOSE, ROOT / "deploy" / "regions" / "compose.yml"])
def test_compose_file_has_no_top_level_name(path: Path) -> None:
    """Compose v1 (Debian's docker-compose 1.29) rejects a top-level `name:`; the project name
    comes from COMPOSE_PROJECT_NAME, -p or the folder."""
    assert "name" not in load(path)
    assert not re.search(r"^name:", path.read_text(), re.M)


def test_override_changes_only_image_names() -> None:
    services = load(COMPOSE)["services"]
    override = load(OVERRIDE)
    assert set(override) == {"services"}
    assert override["services"], "the override names no stand-in"
    for name, svc in override["services"].items():
        assert name in services, f"override names {name}, not a compose service"
        assert set(svc) == {"image"}, f"override changes more than {name}'s image: {set(svc)}"
        assert svc["image"] != services[name]["image"], name
        assert (COMPOSE_DIR / "standins" / name / "Dockerfile").is_file(), name


def test_check_script_reads_the_override_as_yaml_does() -> None:
    check = check_module()
    override = load(OVERRIDE)["services"]
    assert check.standin_names() == {name: svc["image"] for name, svc in override.items()}


def test_check_script_names_the_compose_files_images_services_and_jobs() -> None:
    check = check_module()
    text = COMPOSE.read_text()
    services = load(COMPOSE)["services"]
    strait = {n for n, svc in services.items() if svc["image"] == check.STRAIT_IMAGE}
    infra = {n: svc["image"] for n, svc in services.items() if n not in strait}
    assert check.OFFICIAL == infra
    assert set(check.NO_STANDIN) | set(load(OVERRIDE)["services"]) == set(infra)
    for profile, extra in check.PROFILE_SERVICES.items():
        in_profile = {n for n in strait if profile in services[n].get("profiles", [])}
        assert in_profile == set(extra), profile
    assert set(check.STRAIT_SERVICES) == {n for n in strait if not services[n].get("profiles")}
    for var in check.HOST_PORTS:
        assert re.search(rf'"\$\{{{var}:-\d+\}}:\d+"', text), f"{var} is no published port"
    assert "${OTLP_ENDPOINT-" in text, "traces cannot be switched off with OTLP_ENDPOINT="
    jobs = {job["job_name"] for job in load(PROMETHEUS)["scrape_configs"]}
    for model, victim, worker_jobs in check.PROFILE_CHECKS.values():
        assert set(worker_jobs) <= jobs and victim in strait, (model, victim, worker_jobs)
