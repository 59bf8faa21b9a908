"""Which worker a `strait` command line runs: `strait worker` serves worker.role (or --role),
the entry of that role's package; `strait decode` is `strait worker`, `strait prefill` is
`strait worker --role prefill`."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from libs.settings import Settings
from services import cli
from services.decode import main as decode_main
from services.prefill import main as prefill_main
from services.worker import main as worker_main
from services.worker import process


def run(argv: list[str], role: str = "aggregated") -> tuple[str, Any, str]:
    """(service name, serve function, worker.role) that ``strait <argv>`` would run with
    ``worker.role = role`` in its settings."""
    settings = Settings()
    settings.worker.role = role  # type: ignore[assignment]
    seen: list[tuple[str, Any, str]] = []

    def run_service(name: str, serve: Any, s: Settings, **_: Any) -> int:
        seen.append((name, serve, s.worker.role))
        return 0

    with (
        mock.patch.object(cli, "get_settings", return_value=settings),
        mock.patch.object(process, "run_service", run_service),
    ):
        assert cli.main(argv) == 0
    assert settings.worker.role == role, "the caller's settings are not changed"
    [one] = seen
    return one


@pytest.mark.parametrize(
    ("argv", "role", "expected"),
    [
        (["worker"], "aggregated", ("worker", worker_main.serve, "aggregated")),
        (["worker"], "decode", ("worker", decode_main.serve, "decode")),
        (["worker"], "prefill", ("prefill", prefill_main.serve, "prefill")),
        (["worker", "--role", "decode"], "aggregated", ("worker", decode_main.serve, "decode")),
        (
            ["worker", "--role", "prefill"],
            "aggregated",
            ("prefill", prefill_main.serve, "prefill"),
        ),
        (["decode"], "decode", ("worker", decode_main.serve, "decode")),
        (["decode"], "aggregated", ("worker", worker_main.serve, "aggregated")),
        (["prefill"], "aggregated", ("prefill", prefill_main.serve, "prefill")),
    ],
)
def test_worker_commands_pick_the_role(
    argv: list[str], role: str, expected: tuple[str, Any, str]
) -> None:
    assert run(argv, role) == expected


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["worker", "--role", "router"])
