"""The gateway's JetStream publish: a late ack is published again under the same Nats-Msg-Id
(the stream keeps one copy), and only the last attempt's timeout is a failure."""

from __future__ import annotations

from typing import Any

import pytest

from libs.protocol import GenerateRequest
from libs.settings import Settings
from services.gateway.fleet import DEDUPE_HEADER, Fleet, FleetUnavailable

pytestmark = pytest.mark.unit


class LateAcks:
    """A JetStream context whose first ``late`` publishes time out waiting for their ack."""

    def __init__(self, late: int) -> None:
        self.late = late
        self.calls: list[dict[str, Any]] = []

    async def publish(self, subject: str, data: bytes, headers: Any, timeout: float) -> None:
        self.calls.append({"subject": subject, "headers": dict(headers), "timeout": timeout})
        if len(self.calls) <= self.late:
            raise TimeoutError


class Connected:
    is_connected = True
    max_payload = 1 << 20


def fleet(late: int) -> tuple[Fleet, LateAcks]:
    s = Settings()
    s.gateway.publish_attempts = 3
    s.gateway.publish_ack_timeout_s = 0.5
    f = Fleet(s)
    js = LateAcks(late)
    f.js, f.nc = js, Connected()  # type: ignore[assignment]
    return f, js


async def test_a_late_ack_is_published_again_under_one_message_id() -> None:
    f, js = fleet(late=2)
    await f.publish(GenerateRequest(request_id="r1", prompt="x"))
    assert len(js.calls) == 3
    assert {c["headers"][DEDUPE_HEADER] for c in js.calls} == {"r1"}
    assert all(c["timeout"] == 0.5 for c in js.calls)


async def test_every_attempt_late_is_unavailable() -> None:
    f, js = fleet(late=3)
    with pytest.raises(FleetUnavailable):
        await f.publish(GenerateRequest(request_id="r2", prompt="x"))
    assert len(js.calls) == 3
