"""services.endpoint.Endpoint: decode, validate, refuse, answer, count, once for every handler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from libs.protocol import (
    AssignmentAck,
    CancelRequest,
    DeadLetter,
    ProtocolError,
    Subjects,
    encode,
)
from services.endpoint import (
    MESSAGES,
    Endpoint,
    answers_or_dead_letters,
    dead_letters,
    ignores,
    logs,
)


@dataclass
class FakeNats:
    published: list[tuple[str, bytes]] = field(default_factory=list)

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, data))


@dataclass
class FakeMsg:
    """What an Endpoint reads of a nats-py Msg."""

    data: bytes
    subject: str = "t.cancel.r1"
    reply: str = ""
    headers: dict[str, str] | None = None
    nc: FakeNats = field(default_factory=FakeNats)

    async def respond(self, data: bytes) -> None:
        await self.nc.publish(self.reply, data)


def count(name: str, outcome: str) -> float:
    return MESSAGES.labels(name, outcome)._value.get()


def cancel(rid: str = "r1") -> bytes:
    return encode(CancelRequest(request_id=rid))


async def test_a_message_is_decoded_handled_answered_and_counted() -> None:
    seen: list[tuple[CancelRequest, str]] = []
    observed: list[tuple[str, float]] = []

    async def handle(c: CancelRequest, msg: Any) -> AssignmentAck:
        seen.append((c, msg.subject))
        return AssignmentAck(accepted=True, reason=c.request_id)

    ep = Endpoint(
        "t.ok", CancelRequest, handle, ignores, observe=lambda o, s: observed.append((o, s))
    )
    before = count("t.ok", "ok")
    msg = FakeMsg(cancel("r7"), reply="inbox.1")
    await ep(msg)  # type: ignore[arg-type]
    assert [(c.request_id, subject) for c, subject in seen] == [("r7", "t.cancel.r1")]
    [(subject, data)] = msg.nc.published
    assert subject == "inbox.1"
    assert msgspec.json.decode(data, type=AssignmentAck) == AssignmentAck(
        accepted=True, reason="r7"
    )
    assert count("t.ok", "ok") == before + 1
    assert [o for o, _ in observed] == ["ok"] and observed[0][1] >= 0


async def test_an_answer_without_a_reply_subject_is_not_published() -> None:
    async def handle(c: CancelRequest, msg: Any) -> AssignmentAck:
        return AssignmentAck(accepted=True)

    msg = FakeMsg(cancel())
    await Endpoint("t.noanswer", CancelRequest, handle, ignores)(msg)  # type: ignore[arg-type]
    assert msg.nc.published == []


async def test_a_malformed_message_is_rejected_and_never_handled() -> None:
    rejected: list[ProtocolError] = []
    handled: list[Any] = []

    async def handle(c: CancelRequest, msg: Any) -> None:
        handled.append(c)

    async def reject(msg: Any, e: ProtocolError) -> None:
        rejected.append(e)

    ep = Endpoint("t.bad", CancelRequest, handle, reject)
    before = count("t.bad", "invalid")
    await ep(FakeMsg(b"{not json"))  # type: ignore[arg-type]
    await ep(FakeMsg(b'{"v": 99, "request_id": "r1"}'))  # type: ignore[arg-type]
    assert handled == []
    assert [e.code for e in rejected] == ["invalid_request", "unsupported_version"]
    assert rejected[1].request_id == "r1"
    assert count("t.bad", "invalid") == before + 2


async def test_validate_errors_and_bugs_both_reject() -> None:
    rejected: list[ProtocolError] = []

    async def reject(msg: Any, e: ProtocolError) -> None:
        rejected.append(e)

    async def handle(c: CancelRequest, msg: Any) -> None:
        raise AssertionError("never reached")

    def validate(c: CancelRequest) -> None:
        if c.request_id == "typed":
            raise ProtocolError("invalid_request", "typed refusal")
        raise KeyError("a bug")

    ep = Endpoint("t.validate", CancelRequest, handle, reject, validate=validate)
    await ep(FakeMsg(cancel("typed")))  # type: ignore[arg-type]
    await ep(FakeMsg(cancel("other")))  # type: ignore[arg-type]
    assert [str(e) for e in rejected] == ["typed refusal", "KeyError('a bug')"]
    assert all(e.code == "invalid_request" for e in rejected)


async def test_a_request_without_a_reply_subject_is_rejected_undecoded() -> None:
    rejected: list[str] = []

    async def reject(msg: Any, e: ProtocolError) -> None:
        rejected.append(str(e))

    async def handle(c: CancelRequest, msg: Any) -> None:
        raise AssertionError("never reached")

    ep = Endpoint("cache.fetch", CancelRequest, handle, reject, needs_reply=True)
    before = count("cache.fetch", "no_reply")
    await ep(FakeMsg(b"garbage"))  # type: ignore[arg-type]
    assert rejected == ["fetch without a reply subject"]
    assert count("cache.fetch", "no_reply") == before + 1


async def test_a_failing_handler_is_logged_and_counted_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handle(c: CancelRequest, msg: Any) -> None:
        raise RuntimeError("boom")

    ep = Endpoint("t.error", CancelRequest, handle, ignores)
    before = count("t.error", "error")
    with caplog.at_level(logging.ERROR, logger="strait.endpoint"):
        await ep(FakeMsg(cancel()))  # type: ignore[arg-type]
    assert count("t.error", "error") == before + 1
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)


async def test_stock_rejections() -> None:
    nc = FakeNats()
    subjects = Subjects("t")
    err = ProtocolError("invalid_request", "bad field", "r1")
    refuse = answers_or_dead_letters(
        nc,  # type: ignore[arg-type]
        subjects,
        "svc",
        lambda e: AssignmentAck(accepted=False, reason=str(e)),
        "bad thing: ",
    )
    await refuse(FakeMsg(b"x", reply="inbox.2"), err)  # type: ignore[arg-type]
    await refuse(FakeMsg(b"x"), err)  # type: ignore[arg-type]
    await dead_letters(nc, subjects, "svc")(FakeMsg(b"y"), err)  # type: ignore[arg-type]
    (s1, d1), (s2, d2), (s3, d3) = nc.published
    assert s1 == "inbox.2"
    assert msgspec.json.decode(d1, type=AssignmentAck) == AssignmentAck(
        accepted=False, reason="bad field"
    )
    assert s2 == s3 == subjects.deadletter
    letters = [msgspec.json.decode(d, type=DeadLetter) for d in (d2, d3)]
    assert [(x.error, x.service) for x in letters] == [
        ("bad thing: bad field", "svc"),
        ("bad field", "svc"),
    ]


async def test_logs_rejection_writes_one_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("strait.test_endpoint")
    with caplog.at_level(logging.DEBUG, logger="strait.test_endpoint"):
        await logs(logger, "bad beat")(
            FakeMsg(b"x", subject="t.workers.a"),  # type: ignore[arg-type]
            ProtocolError("invalid_request", "nope"),
        )
    [record] = [r for r in caplog.records if r.name == "strait.test_endpoint"]
    assert record.getMessage() == "bad beat" and record.levelno == logging.WARNING
