"""`strait up`'s supervisor: how crashed children are restarted, and its /metrics ports."""

from __future__ import annotations

from pydantic import Field

from libs.settings.section import Section


class SupervisorSettings(Section):
    """`strait up`'s supervisor (services/supervisor/children.py): how a child process that
    exits on its own is restarted, as operators know it from systemd (``RestartSec``,
    ``StartLimitBurst`` per ``StartLimitIntervalSec``) and Kubernetes (CrashLoopBackOff)."""

    restart_backoff_s: float = Field(default=1.0, ge=0)
    """The first restart of a crash streak is immediate; each next one waits restart_backoff_s,
    doubled every time, at most restart_backoff_max_s."""
    restart_backoff_max_s: float = Field(default=30.0, ge=0)
    """Longest wait before a restart (see `restart_backoff_s`)."""
    restart_reset_s: float = Field(default=60.0, gt=0)
    """A child that ran this long since its last start is healthy again: its next crash starts a
    new streak (restarted at once)."""
    restart_limit: int = Field(default=5, ge=0)
    """More than restart_limit exits within restart_window_s: that child is given up (not
    restarted, with a message naming these settings); the rest of the fleet keeps serving."""
    restart_window_s: float = Field(default=600.0, gt=0)
    """Seconds over which exits are counted against `restart_limit`."""
    metrics_port: int = 9104
    """/metrics of the supervisor (strait_supervisor_restarts_total, ..._given_up); 0: none. A
    port that is taken is skipped with a warning."""
    worker_metrics_base_port: int = 9200
    """First /metrics port of the workers it starts (one each, counting up past taken ones);
    0: its workers get no /metrics listener (tests: no well-known port)."""
