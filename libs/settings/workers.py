"""The workers' settings (`strait decode`, `strait prefill`): their identity and beats, the
prefill -> decode KV handoff, and the fake backend's timing model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libs.settings.section import Section


class WorkerSettings(Section):
    worker_id: str = ""
    """This process's id in subjects, beats and logs; empty: derived from host and pid."""
    pool: str = "default"
    """Pool this worker joins (a `pools[].name`)."""
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    """"aggregated": prefill and decode; "prefill" / "decode": one side of a disaggregated
    pool."""
    beat_interval_s: float = 0.2
    """Seconds between load beats; keep several within `fleet.worker_ttl_s`."""
    metrics_port: int = 0
    """Port of the /health, /ready, /metrics listener; 0: none."""
    max_waiting: int = 256
    """Assignments held but not yet started past this are refused (router tries another worker)."""
    drain_timeout_s: float = 30.0
    """After SIGTERM (or a drain message): seconds running requests get to finish while the
    worker takes no new work; past it, aggregated workers' requests migrate (the router moves
    them once the worker's beats stop), other roles' end with worker_lost. Keep the pod's
    terminationGracePeriodSeconds above this plus fleet.worker_ttl_s."""
    report_usage: bool = True
    """Publish each finished request's UsageEvent (source "worker") to the ledger's stream, so
    the ledger has its row even when the gateway or client that sent it is gone; a gateway's
    own later event for the same request id replaces it (the ledger keeps the latest)."""
    usage_publish_timeout_s: float = 5.0
    """Seconds a worker waits for JetStream's ack of a usage event."""
    usage_publish_attempts: int = Field(default=3, ge=1)
    """Times a usage event is published (one Nats-Msg-Id) before it is given up with a warning."""
    standby: bool = False
    """Warm standby (docs/planner.md): load the model and connect, then wait for SIGUSR1 before
    beating and taking work (`strait up` sets it for `planner.warm_standby` workers)."""
    batch_delta_tokens: int = Field(default=16, ge=1)
    """Tokens a `priority: "batch"` request's stream delta carries (its choice's last delta
    fewer): batch answers are read whole, and each delta costs the worker, nats-server, the
    router and the reader work beside interactive requests (services/worker/coalesce.py;
    aggregated workers). 1: a delta a token, as interactive requests always get."""
    resend_window: int = 256
    """Stream messages each stream keeps for readers that lost some (ResendRequest); 0: no
    resends."""
    resend_keep_s: float = 10.0
    """Seconds a finished stream's messages are kept for resends."""


class HandoffSettings(Section):
    """Disaggregated pools: the prefill → decode KV handoff (libs/protocol/handoff.py)."""

    request_timeout_s: float = 15.0
    """Seconds the prefill worker waits for a decode worker's answer to an offer or a commit.
    As long as the decode side keeps the reservation: a decode worker that is only busy (a
    long engine step before it can import the blocks, on a loaded machine) must not turn
    into a 503; a dead one stops beating and the router stops offering it work."""
    reservation_ttl_s: float = 15.0
    """Seconds a decode worker keeps an accepted, uncommitted transfer before dropping it."""
    chunk_bytes: int = 0
    """Bytes of one KV chunk message; 0: nats.max_payload less room for headers."""
    max_offers: int = 3
    """Decode workers one request is offered to before it fails with no_capacity."""


class FakeEngineSettings(Section):
    """Timing model of the FAKE backend (load tests of routing, streaming and the planner; never
    a model's results). A decode token costs ``per_token_s`` with one request running and
    ``per_row_s`` more for each other request the worker runs (a real engine's step grows with
    its rows); a prompt costs ``per_prompt_token_s`` per uncached token before the first token.
    configs/fake-calibrated.toml holds the values measured on the real worker
    (bench/fake_calibration.py, docs/autoscaling.md)."""

    per_token_s: float = Field(default=0.01, ge=0)
    """Seconds of one decode token with one request running."""
    per_row_s: float = Field(default=0.0, ge=0)
    """Seconds a decode token costs more for each other request the worker runs."""
    per_prompt_token_s: float = Field(default=0.0002, ge=0)
    """Seconds per uncached prompt token before the first token."""
    max_model_len: int = 4096
    """Context length the fake model reports (prompt + max_tokens past it:
    context_length_exceeded)."""
    answer_words: int = Field(default=0, ge=0)
    """Words of a text answer before it ends with finish_reason "stop" (a model's end of
    sequence), when fewer than the request's max_tokens; 0: every answer runs to max_tokens
    ("length"). Agent loops need answers that end: an SDK reads "length" as a failed turn."""
