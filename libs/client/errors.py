"""Exceptions of the NATS client: one class per ``ErrorMessage`` code, plus client-side failures.

Every exception is a :class:`StraitError` carrying ``code`` (the wire ``ErrorCode``, or a
client-side code such as ``payload_too_large``), ``request_id``, ``param`` and ``retry_after_s``.
:class:`Retryable` marks the errors where the same request may succeed later (the fleet is busy or
lost a worker); everything else will fail the same way again.
"""

from __future__ import annotations

from libs.protocol import ErrorMessage


class StraitError(Exception):
    """Base of every error the client raises. ``code`` is machine-readable."""

    code: str = "error"

    def __init__(
        self,
        message: str,
        *,
        request_id: str = "",
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param
        self.retry_after_s = retry_after_s
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        where = f" [request {self.request_id}]" if self.request_id else ""
        return f"{self.code}: {self.message}{where}"


class Retryable(StraitError):
    """The fleet could not serve the request now; retry after ``retry_after_s`` (when set)."""


class InvalidRequest(StraitError):
    code = "invalid_request"


class UnsupportedVersion(InvalidRequest):
    code = "unsupported_version"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class PayloadTooLarge(InvalidRequest):
    """Raised by the client before publishing: the encoded request exceeds ``max_payload``."""

    code = "payload_too_large"


class ModelNotFound(StraitError):
    code = "model_not_found"


class NoCapacity(Retryable):
    code = "no_capacity"


class NoWorker(Retryable):
    code = "no_worker"


class RateLimited(Retryable):
    code = "rate_limited"


class PermissionDenied(StraitError):
    """The sender's team is revoked (docs/security.md)."""

    code = "permission_denied"


class WorkerLost(Retryable):
    code = "worker_lost"


class OverShare(Retryable):
    """The team already has its bound of requests waiting for the pool (flow control,
    docs/flow-control.md): retry after ``retry_after_s``."""

    code = "over_share"


class DeadlineExceeded(StraitError):
    """The request waited for room past its queue deadline (``queue_timeout_s``)."""

    code = "deadline_exceeded"


class FleetUnavailable(Retryable):
    """The request could not be queued: NATS is down or no JetStream stream takes the subject."""

    code = "unavailable"


class Cancelled(StraitError):
    code = "cancelled"


class Timeout(StraitError, TimeoutError):
    """The fleet said ``timeout``, or the client waited longer than its first-token/idle limit."""

    code = "timeout"


class InternalError(StraitError):
    code = "internal_error"


class IncompleteStream(StraitError):
    """The stream ended while an earlier message (by ``seq``) never arrived."""

    code = "stream_gap"


# Every wire ErrorCode → its class (a test checks the mapping covers protocol.ErrorCode).
ERROR_CLASSES: dict[str, type[StraitError]] = {
    "invalid_request": InvalidRequest,
    "unsupported_version": UnsupportedVersion,
    "context_length_exceeded": ContextLengthExceeded,
    "model_not_found": ModelNotFound,
    "no_capacity": NoCapacity,
    "no_worker": NoWorker,
    "rate_limited": RateLimited,
    "permission_denied": PermissionDenied,
    "cancelled": Cancelled,
    "timeout": Timeout,
    "internal_error": InternalError,
    "worker_lost": WorkerLost,
    "over_share": OverShare,
    "deadline_exceeded": DeadlineExceeded,
}


def error_from_message(msg: ErrorMessage) -> StraitError:
    """The exception for a stream ``ErrorMessage``; an unknown code gives a plain StraitError."""
    cls = ERROR_CLASSES.get(msg.code, StraitError)
    return cls(
        msg.message,
        request_id=msg.request_id,
        param=msg.param,
        retry_after_s=msg.retry_after_s,
        code=msg.code,
    )
