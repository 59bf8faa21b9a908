"""Settings that moved to ``[fleet]`` still apply under their old names, with one warning each."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.settings import FleetSettings, GatewaySettings, RouterSettings, Settings, renames

pytestmark = pytest.mark.unit

LOGGER = "libs.settings.renames"


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No settings file unless a test writes one, no STRAIT_* variable from outside, and every
    old name not yet warned about."""
    for name in list(os.environ):
        if name.startswith("STRAIT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STRAIT_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setattr(renames, "_warned", set())
    yield


def config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    path = tmp_path / "strait.toml"
    path.write_text(text)
    monkeypatch.setenv("STRAIT_CONFIG", str(path))
    return path


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_an_old_variable_applies_with_one_warning_naming_the_new_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("STRAIT_ROUTER__WORKER_TTL_S", "4.5")
    with caplog.at_level(logging.WARNING, LOGGER):
        first, second = Settings(), Settings()
    assert first.fleet.worker_ttl_s == second.fleet.worker_ttl_s == 4.5
    [message] = warnings(caplog)
    assert "STRAIT_ROUTER__WORKER_TTL_S in the environment" in message
    assert "fleet.worker_ttl_s" in message and "STRAIT_FLEET__WORKER_TTL_S" in message


def test_old_names_in_a_file_apply_and_each_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = config(
        monkeypatch,
        tmp_path,
        "[router]\nworker_ttl_s = 3.0\nreplace_lost = false\nretry_after_s = 7.5\n"
        "[gateway]\nmax_pool_queue = 9\nretry_after_s = 4\n",
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        s = Settings()
    assert s.fleet == FleetSettings(worker_ttl_s=3.0, replace_lost=False, retry_after_s=7.5)
    assert (s.gateway.shed_queue_depth, s.gateway.shed_retry_after_s) == (9, 4.0)
    got = warnings(caplog)
    assert len(got) == 5 and all(str(path) in m for m in got)
    assert any("gateway.max_pool_queue" in m and "gateway.shed_queue_depth" in m for m in got)


def test_the_new_name_wins_within_one_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config(
        monkeypatch,
        tmp_path,
        "[fleet]\nworker_ttl_s = 1.0\n[router]\nworker_ttl_s = 3.0\n"
        "[gateway]\nshed_queue_depth = 5\nmax_pool_queue = 512\n",
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        s = Settings()
    assert (s.fleet.worker_ttl_s, s.gateway.shed_queue_depth) == (1.0, 5)
    got = warnings(caplog)
    assert len(got) == 2 and all("ignored" in m for m in got)
    assert any("ignored, gateway.shed_queue_depth is set" in m for m in got)


def test_an_old_variable_still_beats_the_files_new_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config(monkeypatch, tmp_path, "[gateway]\nshed_retry_after_s = 1.0\n")
    monkeypatch.setenv("STRAIT_GATEWAY__RETRY_AFTER_S", "3")
    assert Settings().gateway.shed_retry_after_s == 3.0


def test_the_routers_queue_bound_keeps_its_name() -> None:
    """``router.max_pool_queue`` (the hard bound) and ``gateway.shed_queue_depth`` (the
    gateway's earlier shedding) are two settings, each with its own default."""
    s = Settings(router={"max_pool_queue": 7})
    assert (s.router.max_pool_queue, s.gateway.shed_queue_depth) == (7, 256)


def test_constructor_arguments_are_renamed_without_changing_the_callers_dict() -> None:
    router = {"worker_ttl_s": 0.4, "spill_over": False}
    s = Settings(router=router)
    assert (s.fleet.worker_ttl_s, s.router.spill_over) == (0.4, False)
    assert router == {"worker_ttl_s": 0.4, "spill_over": False}


def test_every_old_name_left_its_section_and_every_new_name_exists() -> None:
    sections = {"router": RouterSettings, "gateway": GatewaySettings, "fleet": FleetSettings}
    for (old_sec, old_field), (new_sec, new_field) in renames.RENAMED.items():
        assert old_field not in sections[old_sec].model_fields, f"{old_sec}.{old_field}"
        assert new_field in sections[new_sec].model_fields
