"""Every service's /metrics shows populated histograms after traffic."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.support.procs import ProcessFleet
from bench.support.services import free_port

pytestmark = pytest.mark.e2e

FAKE_FLEET = """
[gateway]
auth_enabled = false
open_metrics = true
[fake_engine]
per_token_s = 0.002
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""


def histogram_count(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return sum(s.value for s in fam.samples if s.name == f"{name}_count")
    raise AssertionError(f"{name} not exported")


def test_histograms_populated_on_every_service(tmp_path: Path, nats_url: str) -> None:
    router_port, worker_port = free_port(), free_port()
    env = {
        "STRAIT_NATS__SUBJECT_PREFIX": "metrics.v1",
        "STRAIT_ROUTER__METRICS_PORT": str(router_port),
    }
    workers = [{"STRAIT_WORKER__METRICS_PORT": str(worker_port)}]
    with ProcessFleet(tmp_path, nats_url, FAKE_FLEET, env=env, workers=workers) as fleet:
        for i in range(3):
            r = httpx.post(
                f"{fleet.base_url}/v1/completions",
                json={
                    "model": "default",
                    "prompt": f"count me {i}",
                    "max_tokens": 5,
                    "stream": i == 0,
                },
                timeout=30,
            )
            assert r.status_code == 200
        gateway = httpx.get(f"{fleet.base_url}/metrics", timeout=5).text
        router = httpx.get(f"http://127.0.0.1:{router_port}/metrics", timeout=5).text
        worker = httpx.get(f"http://127.0.0.1:{worker_port}/metrics", timeout=5).text
    assert histogram_count(gateway, "strait_gateway_ttft_seconds") == 3
    assert histogram_count(gateway, "strait_gateway_e2e_seconds") == 3
    assert histogram_count(router, "strait_router_decision_seconds") == 3
    assert histogram_count(router, "strait_router_queue_seconds") == 3
    assert histogram_count(worker, "strait_worker_ttft_seconds") == 3
    assert histogram_count(worker, "strait_worker_itl_seconds") == 3 * 4
    assert histogram_count(worker, "strait_worker_e2e_seconds") == 3
    assert histogram_count(worker, "strait_worker_queue_seconds") == 3
