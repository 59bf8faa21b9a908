"""libs.wire.nats_util.publish_acked: what the gateway, the workers and the client library publish
to JetStream with. A missing ack or a stream not back yet is published again under the same
Nats-Msg-Id; anything else, and the last attempt's error, is raised."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.errors import NoStreamResponseError

from libs.wire import nats_util
from libs.wire.nats_util import DEDUPE_HEADER, publish_acked

pytestmark = pytest.mark.unit


class Failing:
    """A JetStream context whose first publishes raise the given errors, in order."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls: list[dict[str, Any]] = []

    async def publish(self, subject: str, data: bytes, headers: Any, timeout: float) -> None:
        self.calls.append({"headers": dict(headers), "timeout": timeout})
        if self.errors:
            raise self.errors.pop(0)


async def test_missing_acks_and_a_missing_stream_are_published_again_under_one_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nats_util, "PUBLISH_RETRY_PAUSE_S", 0.0)
    js = Failing(TimeoutError(), NoStreamResponseError())
    await publish_acked(js, "s", b"x", "r1", 0.5, 3, headers={"traceparent": "t"})  # type: ignore[arg-type]
    assert len(js.calls) == 3
    assert [c["headers"] for c in js.calls] == [{"traceparent": "t", DEDUPE_HEADER: "r1"}] * 3
    assert {c["timeout"] for c in js.calls} == {0.5}


async def test_the_last_attempts_error_and_other_errors_are_raised() -> None:
    js = Failing(TimeoutError(), TimeoutError())
    with pytest.raises(TimeoutError):
        await publish_acked(js, "s", b"x", "r2", 0.1, 2)  # type: ignore[arg-type]
    assert len(js.calls) == 2
    js = Failing(ValueError("bad"))
    with pytest.raises(ValueError):
        await publish_acked(js, "s", b"x", "r3", 0.1, 3)  # type: ignore[arg-type]
    assert len(js.calls) == 1
