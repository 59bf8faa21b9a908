"""Processes migrating one new SQLite file at once (the gateway and `strait batch` started
together) all succeed: ``Database.migrate`` takes a lock file beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

MIGRATE = """
import asyncio, sys
from libs.db import Database
from libs.settings import Settings
asyncio.run(Database(Settings(), url=sys.argv[1]).migrate())
"""


def test_processes_migrating_a_new_sqlite_file_at_once(tmp_path: Path) -> None:
    # Without the lock, 4 processes failed ("table ... already exists") 3 times of 3.
    url = f"sqlite+aiosqlite:///{tmp_path / 'strait.db'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)[-3000:]
