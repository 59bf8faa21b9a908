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
from services.supervisor.fleet import Fleet

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
    assert [c.name for c in children] == ["router", "aggregated a-w0", "gateway"]
    assert child_settings(children[1]).worker.role == "aggregated"


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
        "gateway",
    ]
    roles = {c.name: child_settings(c).worker.role for c in children}
    assert roles["decode default-w0"] == "decode" and roles["prefill default-p0"] == "prefill"


def test_activated_standbys_are_replaced_one_at_a_time_after_the_refill_delay(
    tmp_path: Path,
) -> None:
    """Three standbys activated by one scale-up: their replacements start loading
    planner.standby_refill_s after the last activation, then one every standby_refill_s (not
    all at once on the cores that serve the wave)."""
    from libs.settings import PlannerSettings, PoolSettings

    settings = Settings(
        pools=[PoolSettings(name="p", model="fake-model", backend="fake", workers=1)],
        planner=PlannerSettings(enabled=True, warm_standby=3, standby_refill_s=5.0),  # type: ignore[arg-type]
    )
    with mock.patch("subprocess.Popen") as popen, mock.patch("time.monotonic") as clock:
        popen.return_value.poll.return_value = None  # every child alive
        popen.return_value.pid = 1
        fleet = Fleet(settings)
        fleet.plan()
        fleet.start_all()
        standbys = [c for c in fleet.children if c.standby]
        assert len(standbys) == 3
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
