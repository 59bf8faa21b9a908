"""One request is one trace: gateway → router → worker (prefill, decode), across processes."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx
import pytest

from bench.support.procs import ProcessFleet
from tests.support.otlp import OtlpReceiver

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


DISAGG_FLEET = """
[gateway]
auth_enabled = false
[engine]
kv_cache_bytes = 67108864
[[pools]]
name = "default"
model = "smollm2-135m-instruct"
backend = "engine"
mode = "disaggregated"
"""


@pytest.mark.slow
def test_a_disaggregated_request_is_one_trace_through_the_handoff(
    tmp_path: Path, nats_url: str
) -> None:
    """gateway → router → prefill (prefill worker) → kv_handoff → worker.generate → decode
    (decode worker): four processes, one trace, each span the child of the one before."""
    from libs.models import prepare_model
    from libs.settings import Settings

    model_dir = prepare_model("smollm2-135m-instruct", Settings(), progress=False)
    want = {"gateway.request", "router.route", "prefill", "kv_handoff", "worker.generate", "decode"}
    with OtlpReceiver() as otlp:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "STRAIT_NATS__SUBJECT_PREFIX": "dtrace.v1",
            "STRAIT_MODELS__DIR": str(model_dir.parent.resolve()),
        }
        with ProcessFleet(
            tmp_path,
            nats_url,
            DISAGG_FLEET,
            env=env,
            workers=[{"STRAIT_WORKER__ROLE": "decode"}],
            extra_services=[("prefill", "prefill", {"STRAIT_WORKER__WORKER_ID": "p0"})],
            ready_timeout_s=180,
        ) as fleet:
            r = httpx.post(
                f"{fleet.base_url}/v1/completions",
                json={"model": "default", "prompt": "a long enough prompt " * 4, "max_tokens": 4},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not want <= {s.name for s in otlp.spans}:
                time.sleep(0.2)
    by_name = {s.name: s for s in otlp.spans}
    assert want <= set(by_name), [s.name for s in otlp.spans]
    chain = [by_name[n] for n in ("gateway.request", "router.route", "prefill", "kv_handoff")]
    chain += [by_name["worker.generate"], by_name["decode"]]
    assert len({s.trace_id for s in chain}) == 1
    for parent, child in itertools.pairwise(chain):
        assert child.parent_span_id == parent.span_id, (parent.name, child.name)
    assert by_name["prefill"].service == "strait-prefill"
    assert by_name["worker.generate"].service == "strait-worker"
    handoff = by_name["kv_handoff"].attributes
    assert handoff["strait.kv_blocks"] >= 1 and handoff["strait.kv_bytes"] > 0
