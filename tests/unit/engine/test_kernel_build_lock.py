"""A process killed while torch loads the kernels leaves torch's lock file behind; the next
worker must not wait for it forever (libs/engine/kernels/build_lock.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from libs.engine.kernels.build_lock import BATON_NAME, exclusive_build

pytestmark = pytest.mark.unit


def _hold_and_hang(build_dir: str, ready: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    with exclusive_build(Path(build_dir)):
        (Path(build_dir) / BATON_NAME).touch()  # as torch's FileBaton does
        ready.set()
        time.sleep(60)


def test_a_lock_file_left_by_a_killed_process_is_removed_by_the_next(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_and_hang, args=(str(tmp_path), ready))
    p.start()
    assert ready.wait(10)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)  # dies holding both: the flock goes with it, the file stays
    p.join(10)
    assert (tmp_path / BATON_NAME).exists()
    with exclusive_build(tmp_path):
        assert not (tmp_path / BATON_NAME).exists()
    assert time.monotonic() - t0 < 5


def test_a_live_holder_is_waited_for(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_and_hang, args=(str(tmp_path), ready))
    p.start()
    try:
        assert ready.wait(10)
        waiter = ctx.Process(target=_enter, args=(str(tmp_path),))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive()  # blocked on the live holder's flock
        assert (tmp_path / BATON_NAME).exists()  # and the live holder's file was not touched
        p.kill()
        waiter.join(10)
        assert waiter.exitcode == 0
    finally:
        p.kill()


def _enter(build_dir: str) -> None:
    with exclusive_build(Path(build_dir)):
        pass
