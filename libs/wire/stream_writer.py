"""Writing one request's token stream: consecutive ``seq`` numbers, the last messages kept for
readers' ``ResendRequest``s, and nothing written once the worker no longer owns the stream.

Who writes: the workers (``services.worker``: one :class:`StreamWriter` per running request,
kept a while after it ends for resends). The reader's side is ``libs.wire.stream_reader``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS

from libs.protocol import encode


class StreamTaken(Exception):
    """The writer's worker no longer owns its streams (see ``StreamWriter``'s ``owner``)."""


class StreamWriter:
    """Publishes one request's stream messages with consecutive ``seq`` numbers.

    ``owner`` (optional) is asked before every publish; when it answers False, ``send`` raises
    :class:`StreamTaken` and publishes nothing: a worker that the router presumed lost (its
    beats stopped long enough) must not write into a stream another worker now continues."""

    def __init__(
        self,
        nc: NATS,
        subject: str,
        request_id: str,
        first_seq: int = 1,
        owner: Callable[[], bool] | None = None,
        keep: int = 0,
        key: str = "",
    ) -> None:
        self._nc = nc
        self.subject = subject
        self.request_id = request_id  # as the stream's messages name it
        self.key = key or request_id  # GenerateRequest.key: how the worker's maps know it
        self._seq = first_seq - 1  # a decode worker continues a stream a prefill worker began
        self._owner = owner
        # The last ``keep`` messages sent, as (seq, bytes), for resend().
        self.sent: deque[tuple[int, bytes]] = deque(maxlen=keep)  # keep = 0: nothing kept

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def peek_seq(self) -> int:
        """The seq the next message would get (handed to whoever continues the stream)."""
        return self._seq + 1

    async def send(self, msg: msgspec.Struct) -> None:
        if self._owner is not None and not self._owner():
            raise StreamTaken(self.request_id)
        data = encode(msg)
        await self._nc.publish(self.subject, data)
        self.sent.append((getattr(msg, "seq", 0), data))

    async def resend(self, from_seq: int) -> int:
        """Publish again the kept messages from ``from_seq`` on; returns how many."""
        if self._owner is not None and not self._owner():
            return 0
        again = [data for seq, data in self.sent if seq >= from_seq]
        for data in again:
            await self._nc.publish(self.subject, data)
        return len(again)
