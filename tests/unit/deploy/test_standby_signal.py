"""A standby activated while it still starts: `strait up` sends SIGUSR1 whenever the planner
wants a worker, and a standby started a moment before may not have armed its handler yet (a
FAKE worker took 40 s to import on the loaded 2-core VM). The supervisor starts standbys with
SIGUSR1 blocked, so the signal waits instead of killing the process (its default action)."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.supervisor.children import Child

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

# The worker's start, slowed: imports, then arm_signals, then whether it was activated/parked.
SLOW_STANDBY = textwrap.dedent(
    """
    import time
    time.sleep(1.5)
    from libs.settings import Settings
    from services.worker import process as main
    s = Settings()
    s.worker.standby = True
    main.arm_signals(s)
    time.sleep(0.2)
    print("activated" if main._ACTIVATED.is_set() else "waiting", flush=True)
    print("parked" if main._PARKED.is_set() else "serving", flush=True)
    """
)


@pytest.mark.parametrize("standby", [True, False])
def test_an_early_activation_waits_for_the_handler(standby: bool, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    argv = [
        sys.executable,
        "-c",
        f"import sys; sys.stdout = open({str(out)!r}, 'w')\n" + SLOW_STANDBY,
    ]
    child = Child("standby", argv, {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"}, standby=standby)
    child.start()
    assert child.proc is not None
    time.sleep(0.5)  # still "importing"
    child.proc.send_signal(signal.SIGUSR1)
    code = child.proc.wait(timeout=60)
    if standby:
        assert code == 0 and out.read_text().split() == ["activated", "serving"]
    else:  # what happened before: the default action ends the process
        assert code == -signal.SIGUSR1


@pytest.mark.parametrize("activate_too", [False, True])
def test_an_early_park_waits_for_the_handler(activate_too: bool, tmp_path: Path) -> None:
    """A worker parked (SIGUSR2) while it still loads is parked once its handlers are armed,
    not killed. Parked and activated while loading: it serves (the order of two pending
    signals is lost; a worker too many is the safe side)."""
    out = tmp_path / "out.txt"
    argv = [
        sys.executable,
        "-c",
        f"import sys; sys.stdout = open({str(out)!r}, 'w')\n" + SLOW_STANDBY,
    ]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"}
    parked = Child("w", argv, env, pool="p", role="aggregated")
    parked.start()
    assert parked.proc is not None
    time.sleep(0.5)
    parked.proc.send_signal(signal.SIGUSR2)
    if activate_too:
        parked.proc.send_signal(signal.SIGUSR1)
    assert parked.proc.wait(timeout=60) == 0
    want = ["activated", "serving"] if activate_too else ["waiting", "parked"]
    assert out.read_text().split() == want
