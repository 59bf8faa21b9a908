"""The fault campaign's scenarios that fit CI's time (bench/chaos/; the whole campaign and its
table are in docs/reliability.md): FAKE-engine fleets of separate processes under 40 streams,
a worker killed, a worker paused, a NATS server restarted, 10,000 malformed messages — and no
request hangs, no token is lost or doubled, no ledger row is lost or wrong, nothing is held."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos.campaign import campaign
from bench.chaos.fleet import Opts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIOS = ["kill-worker", "sigstop-worker", "restart-nats", "malformed"]


async def test_faults_lose_nothing(tmp_path: Path) -> None:
    rows = await campaign(SCENARIOS, Opts(run_dir=tmp_path))
    assert [r["scenario"] for r in rows] == SCENARIOS, "a scenario's fleet did not start"
    for r in rows:
        name = r["scenario"]
        assert r["crashed"] == [], name  # first: a crashed router shows as every request hanging
        assert r["hangs"] == 0, (name, r["hang_ids"])
        assert r["bad_text"] == 0, (name, r["bad_text_ids"])
        assert (r["ledger_lost"], r["ledger_wrong"]) == (0, 0), name
        assert r["held_after_total"] == 0, name
        # Open streams move or recover; only requests sent while NATS was down may fail, and
        # then with the typed "fleet unavailable" error (HTTP 503 / the client's no_worker).
        sent_while_down = ("http 503 no_worker", "nats no_worker")
        unexplained = r["failed"] - sum(r["failed_by"].get(k, 0) for k in sent_while_down)
        assert unexplained == 0, (name, r["failed_by"])
    migrated = {r["scenario"]: r["migrated"] for r in rows}
    assert migrated["kill-worker"] > 0 and migrated["sigstop-worker"] > 0
