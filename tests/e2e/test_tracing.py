"""One request is one trace: gateway → router → worker (prefill, decode), across processes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.otlp import OtlpReceiver
from tests.support.procs import ProcessFleet

pytestmark = pytest.mark.e2e

FAKE_FLEET = """
[gateway]
auth_enabled = false
[[pools]]
name = "default"
model = "fake-model"
backend = "fake"
"""


def test_one_trace_per_request_in_parent_order(tmp_path: Path, nats_url: str) -> None:
    with OtlpReceiver() as otlp:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "STRAIT_NATS__SUBJECT_PREFIX": "trace.v1",
        }
        with ProcessFleet(tmp_path, nats_url, FAKE_FLEET, env=env) as fleet:
            r = httpx.post(
                f"{fleet.base_url}/v1/completions",
                json={"model": "default", "prompt": "trace me", "max_tokens": 4},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                names = {s.name for s in otlp.spans}
                if {
                    "gateway.request",
                    "router.route",
                    "worker.generate",
                    "prefill",
                    "decode",
                } <= names:
                    break
                time.sleep(0.2)
    spans = otlp.spans
    by_name = {s.name: s for s in spans}
    assert {"gateway.request", "router.route", "worker.generate", "prefill", "decode"} <= set(
        by_name
    ), [s.name for s in spans]
    gw, rt, wk = by_name["gateway.request"], by_name["router.route"], by_name["worker.generate"]
    # One trace, and each hop is a child of the one before.
    assert len({gw.trace_id, rt.trace_id, wk.trace_id, by_name["prefill"].trace_id}) == 1
    assert rt.parent_span_id == gw.span_id
    assert wk.parent_span_id == rt.span_id
    assert by_name["prefill"].parent_span_id == wk.span_id
    assert by_name["decode"].parent_span_id == wk.span_id
    assert wk.attributes["strait.request_id"] == rid
    assert {gw.service, rt.service, wk.service} == {
        "strait-gateway",
        "strait-router",
        "strait-worker",
    }
