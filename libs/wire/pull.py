"""One JetStream pull consumer read in a loop, written once: the fetch with its timeout, the
retry when JetStream refuses, the decode of each message and what is logged.

Every pull loop of the fleet reads through a :class:`PullEndpoint`: the router's request
streams (``services/router/service.py``), the usage ledger (``libs/db/ledger.py``), the batch
runner (``services/gateway/batch_runner.py``) and the client's event observer
(``libs/client/observe.py``). Each loop keeps only what is its own: how many messages it takes
at once, when it stops, what it does with a message. ``services/endpoint.py``'s ``Endpoint``
is the core-NATS twin (a subscription's handler); this one lives in ``libs/`` because the
client library reads events with it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Generic, Literal, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError, NotFoundError

from libs.log import fields
from libs.protocol import ProtocolError, decode

T = TypeVar("T", bound=msgspec.Struct)

# Seconds one fetch waits for messages before it returns none (the loop then looks at whether
# it should stop); a loop may pass its own.
FETCH_WAIT_S = 0.5
# Pause after a fetch JetStream refused (a server restarting answers a pending fetch with 503;
# the connection reconnects and fetching works again).
FETCH_RETRY_S = 0.5


class PullEndpoint(Generic[T]):
    """A bound pull subscription whose messages decode as ``type_``.

    ``name`` names the loop in logs. A message that does not decode is logged and, by ``bad``,
    acked or terminated: never redelivered. ``retry_not_found``: a deleted consumer is retried
    like a refused fetch instead of raised (raised, the loop ends and its owner provisions the
    consumer again). ``context``: fields of its log lines (the stream it reads, ...)."""

    def __init__(
        self,
        name: str,
        type_: type[T],
        psub: JetStreamContext.PullSubscription,
        log: logging.Logger,
        *,
        wait_s: float = FETCH_WAIT_S,
        bad: Literal["ack", "term"] = "term",
        retry_not_found: bool = False,
        context: dict[str, str] | None = None,
    ) -> None:
        self.name, self.type_, self.psub, self.log = name, type_, psub, log
        self.context = context or {}  # fields of every log line (the stream read, ...)
        self.wait_s, self.bad, self.retry_not_found = wait_s, bad, retry_not_found
        self.skipped = 0  # messages that did not decode

    async def fetch(self, batch: int, wait_s: float | None = None) -> list[Msg]:
        """Up to ``batch`` messages; none when none came within ``wait_s`` (default the
        endpoint's) or when JetStream refused the fetch (logged, after ``FETCH_RETRY_S``)."""
        try:
            return await self.psub.fetch(batch, timeout=self.wait_s if wait_s is None else wait_s)
        except (FetchTimeoutError, NatsTimeout, TimeoutError):
            return []
        except NotFoundError:
            if not self.retry_not_found:
                raise  # the consumer is gone
            error = "consumer not found"
        except NatsError as e:
            error = repr(e)
        self.log.warning(
            f"{self.name}: fetch failed; retrying", extra=fields(**self.context, error=error)
        )
        await asyncio.sleep(FETCH_RETRY_S)
        return []

    async def decode(self, msg: Msg) -> T | None:
        """``msg`` as ``type_``; None for one that does not decode (logged, acked or
        terminated)."""
        try:
            return decode(msg.data, self.type_)
        except ProtocolError as e:
            self.skipped += 1
            self.log.warning(
                f"{self.name}: undecodable message dropped",
                extra=fields(**self.context, subject=msg.subject, error=str(e)),
            )
            await (msg.ack() if self.bad == "ack" else msg.term())
            return None

    async def close(self) -> None:
        """Unsubscribe. A pull subscription's queue keeps the fetch status messages it never
        hands out, so draining the connection with it still subscribed waits for the drain
        timeout: drop it first."""
        with contextlib.suppress(Exception):
            await self.psub.unsubscribe()
