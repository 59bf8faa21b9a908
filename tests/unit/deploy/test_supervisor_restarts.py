"""`strait up`'s restart policy (``Child.exited``, supervisor.*): the first restart of a crash
streak at once, then an exponential back-off up to its cap; the streak starts over after a
healthy run; more than ``restart_limit`` exits within ``restart_window_s`` gives the child up."""

from __future__ import annotations

import pytest

from libs.settings import SupervisorSettings
from services.supervisor.children import Child

pytestmark = pytest.mark.unit

POLICY = SupervisorSettings(
    restart_backoff_s=1.0,
    restart_backoff_max_s=5.0,
    restart_reset_s=60.0,
    restart_limit=5,
    restart_window_s=600.0,
)


def crash_at(c: Child, now: float) -> float | None:
    """The child exits at ``now``; if restarted, it starts when its back-off says."""
    delay = c.exited(POLICY, now)
    if delay is not None:
        c.started_at = now + delay
    return delay


def test_restarts_back_off_exponentially_up_to_the_cap() -> None:
    c = Child("router", [], {})
    delays = [crash_at(c, t) for t in (10.0, 11.0, 13.0, 17.0, 23.0)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0]


def test_a_child_that_ran_healthy_restarts_at_once_again() -> None:
    c = Child("router", [], {})
    assert [crash_at(c, t) for t in (10.0, 11.0)] == [0.0, 1.0]
    assert crash_at(c, 11.0 + 1.0 + 61.0) == 0.0  # ran past restart_reset_s


def test_past_the_limit_within_the_window_it_is_given_up_and_old_exits_are_forgotten() -> None:
    c = Child("router", [], {})
    for t in (0.0, 100.0, 200.0, 300.0, 400.0):  # five exits in ten minutes: restarted
        assert crash_at(c, t) is not None
    assert crash_at(c, 500.0) is None and c.given_up  # the sixth within 600 s
    d = Child("worker", [], {})
    for t in (0.0, 100.0, 200.0, 300.0, 400.0, 601.0):  # the first is out of the window
        assert crash_at(d, t) is not None
    assert not d.given_up and len(d.exits) == 5
