"""Per-key rate limits in this gateway's memory (``libs.flow.ratelimit``'s buckets, keyed by API
key id): a key over its requests or tokens per minute gets 429 with Retry-After. With several
gateway replicas each enforces its own share: the limit a key sees is per replica.
"""

from __future__ import annotations

from libs.flow.ratelimit import RateLimiter as Buckets
from libs.flow.ratelimit import Refusal
from services.gateway import metrics
from services.gateway.auth import KeyInfo
from services.gateway.errors import ApiError


class RateLimiter:
    def __init__(self, default_rpm: int, default_tpm: int) -> None:
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self.buckets = Buckets()

    def admit(self, key: KeyInfo, reserve_tokens: int) -> int:
        """Take one request and ``reserve_tokens`` (capped at one minute's worth); returns the
        tokens reserved. Raises ApiError(429) with Retry-After when the key is over a limit."""
        rpm, tpm = key.rpm or self.default_rpm, key.tpm or self.default_tpm
        got = self.buckets.admit(key.key_id, rpm, tpm, reserve_tokens)
        if isinstance(got, Refusal):
            metrics.REJECTED.labels(code="rate_limited").inc()
            raise ApiError(
                429,
                f"rate limit reached for key {key.key_id!r}: {got.message}",
                "rate_limit_exceeded",
                retry_after_s=got.retry_after_s,
            )
        return got

    def settle(self, key: KeyInfo, reserved: int, used: int) -> None:
        self.buckets.settle(key.key_id, reserved, used)

    def refund_request(self, key: KeyInfo) -> None:
        self.buckets.refund_request(key.key_id)
