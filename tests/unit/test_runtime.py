"""libs.runtime: the event loop a service runs on, and the heap it settles once started."""

from __future__ import annotations

import asyncio
import gc
import weakref

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
    async def main() -> None:
        s = Settings()
        s.runtime.gc_freeze = False
        ctx = ServiceContext(name="t", settings=s)
        assert not ctx.ready()
        gc.unfreeze()
        ctx.serving(lambda: True)
        assert ctx.ready() and gc.get_freeze_count() == 0
        s.runtime.gc_freeze = True
        ServiceContext(name="t", settings=s).serving(lambda: True)
        assert gc.get_freeze_count() > 1000  # the imported modules' objects, at least

    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()


class Node:
    peer: Node | None = None


def test_the_heap_keeper_freezes_survivors_and_sweeps_cycles_among_frozen_objects() -> None:
    """What serving allocated is frozen every interval (collections skip it); a cycle that
    forms among frozen objects outlives collections until the next sweep frees it."""

    async def main() -> None:
        s = Settings()
        s.runtime.gc_freeze_interval_s = 0.05
        s.runtime.gc_sweep_interval_s = 0.5
        ServiceContext(name="t", settings=s).serving(lambda: True)
        a, b = Node(), Node()
        a.peer, b.peer = b, a
        ref = weakref.ref(a)
        await asyncio.sleep(0.2)
        # (Not the freeze count: in a long test run, frozen objects of earlier tests are freed
        # meanwhile and the count can fall. The cycle outliving a collection shows a and b
        # were frozen.)
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: the collector does not see the cycle
        await asyncio.sleep(0.5)  # a sweep
        assert ref() is None

    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()


def test_without_gc_freeze_a_cycle_is_collected_as_usual() -> None:
    async def main() -> None:
        s = Settings()
        s.runtime.gc_freeze = False
        ServiceContext(name="t", settings=s).serving(lambda: True)
        a, b = Node(), Node()
        a.peer, b.peer = b, a
        ref = weakref.ref(a)
        await asyncio.sleep(0.1)
        del a, b
        gc.collect()
        assert ref() is None and gc.get_freeze_count() == 0

    gc.unfreeze()
    asyncio.run(main())
