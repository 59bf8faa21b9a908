"""`strait up`'s plan (services/supervisor/fleet.py ``Fleet.plan``) for aggregated and
disaggregated pools: which children, with which command, role, pool, worker id and port.
Nothing is started.

Children read their settings again from the config file their environment names (as under
`strait up`), so each case is a TOML file, and each child's settings are loaded from exactly the
environment the plan gives it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

from libs.settings import Settings
from services.cli import _parser
from services.supervisor.children import Child
from services.supervisor.fleet import WORKER_ID_ENV, Fleet


def standbys_loaded(fleet: Fleet) -> None:
    """Every standby says it has loaded (WorkerStarting "standby", heard by the actuator)."""
    for c in fleet.children:
        if c.standby and c.proc is not None:
            fleet.standby_loaded(c.env[WORKER_ID_ENV], c.proc.pid)


pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


@contextmanager
def config_env(config: Path) -> Iterator[None]:
    """os.environ without the caller's STRAIT_* and with STRAIT_CONFIG=config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRAIT_")}
    env["STRAIT_CONFIG"] = str(config)
    with mock.patch.dict(os.environ, env, clear=True):
        yield


def planned(config: Path) -> list[Child]:
    """The children `strait up` would start with this config file (none is started)."""
    with config_env(config), mock.patch("subprocess.Popen") as popen:
        fleet = Fleet(Settings())
        fleet.plan()
    popen.assert_not_called()
    return fleet.children


def command(c: Child) -> str:
    assert c.argv[1:3] == ["-m", "services.cli"], c.argv
    _parser().parse_args(c.argv[3:])  # a real subcommand
    return c.argv[3]


def child_settings(c: Child) -> Settings:
    """The settings the child process would load from the environment it is given."""
    with mock.patch.dict(os.environ, c.env, clear=True):
        return Settings()


def write_config(tmp: Path, pool: str, cache_enabled: bool) -> Path:
    path = tmp / "strait.toml"
    path.write_text(f"[cache]\nenabled = {str(cache_enabled).lower()}\n\n[[pools]]\n{pool}\n")
    return path


DISAGGREGATED = 'name = "d"\nmode = "disaggregated"\nworkers = 2\nprefill_workers = 1'


def test_disaggregated_pool_with_cache_starts_cache_prefill_and_decode(tmp_path: Path) -> None:
    children = planned(write_config(tmp_path, DISAGGREGATED, cache_enabled=True))
    assert [(c.name, command(c)) for c in children] == [
        ("router", "router"),
        ("cache", "cache"),
        ("decode d-w0", "worker"),
        ("decode d-w1", "worker"),
        ("prefill d-p0", "worker"),
        ("batch", "batch"),
        ("gateway", "gateway"),
    ]
    ports = []
    for c in children:
        s = child_settings(c)
        if command(c) == "worker":
            assert s.worker.pool == "d"
            assert c.argv[-2:] == ["--role", c.role]
            assert s.worker.role == c.role  # decode workers run as role decode
            assert s.worker.worker_id == c.name.split()[1]
            assert s.worker.metrics_port > 0
            ports.append(s.worker.metrics_port)
        if command(c) == "cache":
            assert s.cache.enabled
            ports.append(s.cache.metrics_port)
    router_port = child_settings(children[0]).router.metrics_port
    assert len({*ports, router_port}) == len(ports) + 1, "two children on one port"


def test_disaggregated_pool_without_cache_has_no_cache_service(tmp_path: Path) -> None:
    names = [c.name for c in planned(write_config(tmp_path, DISAGGREGATED, cache_enabled=False))]
    assert "cache" not in names
    assert "prefill d-p0" in names and "decode d-w0" in names


def test_aggregated_pool_starts_aggregated_workers_only(tmp_path: Path) -> None:
    # cache.enabled without a disaggregated pool: no cache service (nothing would use it).
    children = planned(write_config(tmp_path, 'name = "a"\nbackend = "fake"', cache_enabled=True))
    assert [c.name for c in children] == ["router", "aggregated a-w0", "batch", "gateway"]
    assert child_settings(children[1]).worker.role == "aggregated"


def test_the_batch_runner_is_a_process_of_its_own_or_the_gateways(tmp_path: Path) -> None:
    """batch.runner_process (the default): `strait batch` runs the Batch API's lines and the
    gateway's own runner is off; false: no batch process, the gateway runs them."""
    config = write_config(tmp_path, 'name = "a"\nbackend = "fake"', cache_enabled=False)
    by_name = {c.name: c for c in planned(config)}
    assert command(by_name["batch"]) == "batch"
    assert child_settings(by_name["batch"]).batch.runner_nice == 10
    assert not child_settings(by_name["gateway"]).batch.runner_enabled
    config.write_text("[batch]\nrunner_process = false\n\n" + config.read_text())
    by_name = {c.name: c for c in planned(config)}
    assert "batch" not in by_name
    assert child_settings(by_name["gateway"]).batch.runner_enabled


def test_configs_disaggregated_toml() -> None:
    """The one-machine example: one pool, 1 prefill + 1 decode worker, and the cache."""
    config = ROOT / "configs" / "disaggregated.toml"
    with config_env(config):
        s = Settings()
    assert [(p.name, p.mode, p.workers, p.prefill_workers) for p in s.pools] == [
        ("default", "disaggregated", 1, 1)
    ]
    assert s.cache.enabled
    children = planned(config)
    assert [c.name for c in children] == [
        "router",
        "cache",
        "decode default-w0",
        "prefill default-p0",
        "batch",
        "gateway",
    ]
    roles = {c.name: child_settings(c).worker.role for c in children}
    assert roles["decode default-w0"] == "decode" and roles["prefill default-p0"] == "prefill"


@contextmanager
def started_fleet(
    workers: int, warm_standby: int
) -> Iterator[tuple[Fleet, mock.MagicMock, mock.MagicMock]]:
    """A planned and started fleet of one FAKE pool ``p`` with ``warm_standby`` standbys
    (refill every 5 s), its processes mocked (every one alive) and the clock at 0; yields
    (fleet, the mocked Popen, the mocked clock)."""
    from libs.settings import PlannerSettings, PoolSettings

    settings = Settings(
        pools=[PoolSettings(name="p", model="fake-model", backend="fake", workers=workers)],
        planner=PlannerSettings(  # type: ignore[arg-type]
            enabled=True, warm_standby=warm_standby, standby_refill_s=5.0
        ),
    )
    with mock.patch("subprocess.Popen") as popen, mock.patch("time.monotonic") as clock:
        popen.return_value.poll.return_value = None
        popen.return_value.pid = 1
        clock.return_value = 0.0
        fleet = Fleet(settings)
        fleet.plan()
        fleet.start_all()
        yield fleet, popen, clock


def test_activated_standbys_are_replaced_one_at_a_time_after_the_refill_delay(
    tmp_path: Path,
) -> None:
    """Three standbys activated by one scale-up: their replacements start loading
    planner.standby_refill_s after the last activation, then one every standby_refill_s (not
    all at once on the cores that serve the wave)."""
    with started_fleet(workers=1, warm_standby=3) as (fleet, _popen, clock):
        standbys = [c for c in fleet.children if c.standby]
        assert len(standbys) == 3
        standbys_loaded(fleet)
        clock.return_value = 100.0
        fleet.scale("p", "aggregated", 4, "scale_up")
        assert not any(c.standby for c in fleet.children)  # all three serve now

        def spares() -> int:
            return sum(c.standby for c in fleet.children)

        for now, expected in [(104.9, 0), (105.0, 1), (106.0, 1), (110.0, 2), (115.0, 3)]:
            fleet.refill_standby(now)
            assert spares() == expected, now
        fleet.refill_standby(200.0)
        assert spares() == 3  # owed three, started three


def test_scale_down_parks_workers_while_the_role_is_short_of_standbys(tmp_path: Path) -> None:
    """A scale-down sends the surplus workers back to standby (SIGUSR2) while the pool role
    holds fewer than planner.warm_standby, then drains the rest for good (SIGTERM); a scale-up
    activates the parked ones (SIGUSR1) and starts no process."""
    import signal

    with started_fleet(workers=4, warm_standby=2) as (fleet, popen, _clock):
        standbys = [c for c in fleet.children if c.standby]
        assert len(standbys) == 2
        standbys_loaded(fleet)
        # Two standbys activated: four then six serve; the role owes two standbys.
        fleet.scale("p", "aggregated", 6, "scale_up")
        assert len(fleet.workers("p", "aggregated")) == 6 and fleet.standbys("p", "aggregated") == 0
        started = popen.call_count
        popen.return_value.send_signal.reset_mock()
        # Down to three: two parked (the role's standbys again), the third drained for good.
        fleet.scale("p", "aggregated", 3, "scale_down")
        sent = [c.args[0] for c in popen.return_value.send_signal.call_args_list]
        assert sorted(sent) == sorted([signal.SIGUSR2, signal.SIGUSR2, signal.SIGTERM])
        assert fleet.standbys("p", "aggregated") == 2
        assert len(fleet.workers("p", "aggregated")) == 3
        parked = [c for c in fleet.children if c.standby]
        assert all(c.env["STRAIT_WORKER__STANDBY"] == "true" for c in parked)
        # Nothing owed: no replacement starts, and the next scale-up is two signals.
        fleet.refill_standby(100.0)
        assert popen.call_count == started
        popen.return_value.send_signal.reset_mock()
        standbys_loaded(fleet)  # the parked ones say so again
        fleet.scale("p", "aggregated", 5, "scale_up")
        sent = [c.args[0] for c in popen.return_value.send_signal.call_args_list]
        assert sent == [signal.SIGUSR1, signal.SIGUSR1] and popen.call_count == started
        assert len(fleet.workers("p", "aggregated")) == 5


def test_scale_down_takes_the_planners_drain_order_and_unheard_workers_first() -> None:
    """The surplus a scale-down drains: workers the planner's drain_order does not name yet
    (starting: idle), newest first; then its order (fewest requests first); with no order, the
    newest. Pure selection over children (services.supervisor.fleet.surplus)."""
    from services.supervisor.fleet import WORKER_ID_ENV, surplus

    live = [Child(f"w{i}", [], {WORKER_ID_ENV: f"p-w{i}"}) for i in range(4)]  # oldest first

    def ids(cs: list[Child]) -> list[str]:
        return [c.name for c in cs]

    assert ids(surplus(live, 2, ())) == ["w3", "w2"]  # no order: the newest
    assert ids(surplus(live, 2, ["p-w1", "p-w3", "p-w0", "p-w2"])) == ["w1", "w3"]
    # p-w3 not heard yet (just started): it goes before the order's head.
    assert ids(surplus(live, 2, ["p-w0", "p-w2", "p-w1"])) == ["w3", "w0"]
    assert surplus(live, 0, ["p-w0"]) == []


def test_a_scale_down_signals_the_workers_the_order_names() -> None:
    import signal

    with started_fleet(workers=3, warm_standby=0) as (fleet, popen, _clock):
        w = fleet.workers("p", "aggregated")
        popen.return_value.send_signal.reset_mock()
        fleet.scale("p", "aggregated", 2, "scale_down", ["p-w0", "p-w2", "p-w1"])
        assert [c.args[0] for c in popen.return_value.send_signal.call_args_list] == [
            signal.SIGTERM
        ]
        assert w[0].retiring and not w[1].retiring and not w[2].retiring
