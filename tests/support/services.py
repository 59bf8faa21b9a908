"""What the suite does when a real service is missing: skipped locally, a failure with
``CI=true``. The services themselves (nats-server, ports, isolated settings) are in
``bench.support.services``; its ``Unavailable`` reaches ``missing`` through ``tests/conftest.py``.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(what: str) -> None:
    """Skip locally, fail in CI."""
    if IN_CI:
        pytest.fail(f"{what} is required in CI (CI=true) but not available")
    pytest.skip(f"{what} not available")
