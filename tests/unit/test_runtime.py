"""libs.runtime: the event loop a service runs on, and the heap it settles once started."""

from __future__ import annotations

import asyncio
import gc

import pytest
import uvloop

from libs.runtime import ServiceContext, run_loop
from libs.settings import Settings

pytestmark = pytest.mark.unit


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_run_loop_runs_on_the_configured_loop() -> None:
    s = Settings()
    assert s.runtime.event_loop == "asyncio"
    assert not issubclass(run_loop(loop_type(), s), uvloop.Loop)
    s.runtime.event_loop = "uvloop"
    assert issubclass(run_loop(loop_type(), s), uvloop.Loop)


def test_serving_answers_ready_and_freezes_the_start_up_heap_only_when_asked() -> None:
    s = Settings()
    s.runtime.gc_freeze = False
    ctx = ServiceContext(name="t", settings=s)
    assert not ctx.ready()
    gc.unfreeze()
    ctx.serving(lambda: True)
    assert ctx.ready() and gc.get_freeze_count() == 0
    s.runtime.gc_freeze = True
    try:
        ServiceContext(name="t", settings=s).serving(lambda: True)
        assert gc.get_freeze_count() > 1000  # the imported modules' objects, at least
    finally:
        gc.unfreeze()
