"""`strait up`'s warm standbys (services/supervisor/fleet.py): only a standby that has said it
has loaded (``WorkerStarting`` stage "standby", heard by the local actuator) is activated; one
still loading is not counted as serving, and the scale-up starts a worker instead."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.settings import PlannerSettings, PoolSettings, Settings
from services.supervisor.fleet import WORKER_ID_ENV, Fleet

pytestmark = pytest.mark.unit


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    settings = Settings(
        state_dir=str(tmp_path),
        pools=[PoolSettings(name="default", model="fake-model", backend="fake", workers=1)],
        planner=PlannerSettings(enabled=True, warm_standby=2),
    )
    f = Fleet(settings)
    yield f
    for c in f.children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def standby(fleet: Fleet) -> subprocess.Popen[bytes]:
    """A standby child whose process is a stand-in that ignores SIGUSR1 (a worker's handler)."""
    c = fleet.worker_child("default", "aggregated", standby=True)
    code = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(60)"
    c.proc = subprocess.Popen(["python3", "-c", code])
    fleet.children.append(c)
    return c.proc


def test_only_a_standby_that_said_it_loaded_is_activated(fleet: Fleet) -> None:
    first, second = standby(fleet), standby(fleet)
    # Neither has said it loaded: none is activated, none counts as serving.
    assert fleet.activate_standby("default", "aggregated") is None
    assert fleet.workers("default", "aggregated") == []
    fleet.standby_loaded("default-w0", 999_999)  # an earlier process of that id: not this one
    assert fleet.activate_standby("default", "aggregated") is None
    fleet.standby_loaded("default-w1", second.pid)
    c = fleet.activate_standby("default", "aggregated")
    assert c is not None and c.env[WORKER_ID_ENV] == "default-w1" and not c.standby
    assert fleet.workers("default", "aggregated") == [c]
    assert "default-w1" not in fleet.loaded  # a parked worker must say it again
    assert first.poll() is None and second.poll() is None  # SIGUSR1 ignored, both alive


def test_a_scale_up_with_no_loaded_standby_starts_a_worker(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    standby(fleet)
    started: list[str] = []
    monkeypatch.setattr(
        "services.supervisor.children.Child.start", lambda self: started.append(self.name)
    )
    fleet.scale("default", "aggregated", 1, "scale_up")
    assert started == ["aggregated default-w1"]  # a new process, not the loading standby
    assert [c.name for c in fleet.workers("default", "aggregated")] == started
