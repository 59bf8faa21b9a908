"""bench/engine.py's bookkeeping: the figures are held to the highest ceiling it measured."""

from __future__ import annotations

import pytest

from bench.engine import Report, set_ceilings

pytestmark = pytest.mark.unit


def test_ceilings_keep_the_highest_measurement_of_each() -> None:
    r = Report(
        "m",
        params=100,
        weight_bytes=400,
        threads=2,
        prompt_tokens=1,
        max_tokens=1,
        matmul_gflops=0,
        bandwidth_gb_s=0,
        compute_ceiling_tok_s=0,
        bandwidth_ceiling_tok_s=0,
    )
    set_ceilings(r, 150.0, 30.0)
    set_ceilings(r, 120.0, 50.0)  # slower matmul, faster memory minutes later
    assert r.ceilings_measured == [(150.0, 30.0), (120.0, 50.0)]
    assert (r.matmul_gflops, r.bandwidth_gb_s) == (150.0, 50.0)
    assert r.compute_ceiling_tok_s == pytest.approx(150e9 / 200)  # 2 FLOPs per parameter
    assert r.bandwidth_ceiling_tok_s == pytest.approx(50e9 / 400)  # every weight byte once
