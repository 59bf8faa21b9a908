"""Where a service sends a message it cannot parse and cannot answer (no reply subject)."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from libs.log import fields
from libs.protocol import DeadLetter, Subjects, encode

log = logging.getLogger("strait.deadletter")

# Bytes of the bad payload, and characters of the error, kept for diagnosis.
PAYLOAD_HEAD_BYTES = 256
ERROR_CHARS = 1000


async def dead_letter(nc: NATS, subjects: Subjects, msg: Msg, error: str, service: str) -> None:
    log.warning("malformed message", extra=fields(subject=msg.subject, error=error[:200]))
    head = msg.data[:PAYLOAD_HEAD_BYTES].decode("utf-8", errors="replace")
    letter = DeadLetter(
        subject=msg.subject, error=error[:ERROR_CHARS], service=service, payload_head=head
    )
    try:
        await nc.publish(subjects.deadletter, encode(letter))
    except Exception as e:
        log.warning("dead letter publish failed", extra=fields(error=repr(e)))
