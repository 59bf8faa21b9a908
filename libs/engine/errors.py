"""How the engine refuses a request: :class:`BackendError`, with a code from :data:`ErrorCode`
and the request field at fault (``param``, named as the engine's types name it:
``prompt``, ``structured.regex``...; the gateway maps it to the OpenAI field it came from).

Raised by the input checks (:mod:`libs.engine.checks`), the grammar compiler and the engine's
``add_request``; the workers turn it into the wire's ``ErrorMessage``.
"""

from __future__ import annotations

from typing import Literal

# Every code a request can end with. The engine raises invalid_request,
# context_length_exceeded and internal_error; the others are the fleet's (the router's, the
# gateway's, a worker's) and travel in the same ``ErrorMessage.code`` (libs/protocol/
# re-exports this list).
ErrorCode = Literal[
    "invalid_request",
    "unsupported_version",
    "context_length_exceeded",
    "model_not_found",
    "no_capacity",
    "no_worker",
    "rate_limited",
    "permission_denied",
    "cancelled",
    "timeout",
    "internal_error",
    "worker_lost",
    # Flow control (docs/flow-control.md): the tenant has flow.max_waiting requests waiting
    # already; the request waited past its queue deadline.
    "over_share",
    "deadline_exceeded",
]


class BackendError(Exception):
    """A request the backend refuses; ``code`` is an ``ErrorMessage`` code."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param
        self.retry_after_s = retry_after_s
