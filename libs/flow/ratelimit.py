"""Requests-per-minute and tokens-per-minute limits, in one process's memory.

Two token buckets per key, each holding at most one minute of its rate and refilling
continuously. ``admit`` takes one request and a token reservation (prompt estimate + the
output limit) or returns a ``Refusal`` with the seconds until both would fit; ``settle``
corrects the token bucket with the usage the worker reported. Used by the gateway (per API key)
and the router (per team, for requests from NATS and from keys of a team): with several
replicas each enforces its own share. Both reserve :func:`reserve_estimate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.protocol import GenerateRequest

# Characters a token stands for in a prompt text whose tokens no worker has counted yet.
CHARS_PER_TOKEN = 4


def reserve_estimate(req: GenerateRequest) -> int:
    """Tokens to reserve for ``req`` before a worker counts them: the prompt (its token ids, or
    its text, the messages' contents joined, at ``CHARS_PER_TOKEN`` characters a token plus
    one) and ``max_tokens`` for each of the ``n`` choices. The gateway's per-key and the
    router's per-team limits reserve this same amount, and settle it with the real usage."""
    if req.prompt_token_ids is not None:
        prompt = len(req.prompt_token_ids)
    else:
        text = (
            req.prompt if req.prompt is not None else "".join(m.content for m in req.messages or [])
        )
        prompt = len(text) // CHARS_PER_TOKEN + 1
    return prompt + req.sampling.max_tokens * req.sampling.n


# Buckets of keys idle this long are full again and are forgotten.
IDLE_FORGET_S = 120.0


@dataclass
class Bucket:
    rate_per_min: float
    level: float
    at: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        self.level = min(self.rate_per_min, self.level + (now - self.at) * self.rate_per_min / 60.0)
        self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 when it is now)."""
        short = amount - self.level
        return 0.0 if short <= 0 else short * 60.0 / self.rate_per_min


@dataclass
class KeyLimits:
    requests: Bucket
    tokens: Bucket


@dataclass(frozen=True)
class Refusal:
    message: str  # which limit, with its rates
    retry_after_s: float


class RateLimiter:
    def __init__(self) -> None:
        self._keys: dict[str, KeyLimits] = {}
        self._last_sweep = time.monotonic()

    def _limits(self, key: str, rpm: float, tpm: float, now: float) -> KeyLimits:
        lim = self._keys.get(key)
        if lim is None or lim.requests.rate_per_min != rpm or lim.tokens.rate_per_min != tpm:
            lim = KeyLimits(Bucket(rpm, rpm, now), Bucket(tpm, tpm, now))
            self._keys[key] = lim
        lim.requests.refill(now)
        lim.tokens.refill(now)
        return lim

    def admit(self, key: str, rpm: int, tpm: int, reserve_tokens: int) -> int | Refusal:
        """Take one request and ``reserve_tokens`` (capped at one minute's worth) from ``key``;
        returns the tokens reserved, or a Refusal (nothing taken) when over a limit."""
        now = time.monotonic()
        self._sweep(now)
        lim = self._limits(key, float(rpm), float(tpm), now)
        reserve = float(min(max(reserve_tokens, 0), lim.tokens.rate_per_min))
        wait_req = lim.requests.wait_s(1.0)
        wait_tok = lim.tokens.wait_s(reserve)
        if wait_req > 0 or wait_tok > 0:
            which = "requests per minute" if wait_req >= wait_tok else "tokens per minute"
            return Refusal(
                f"{which} (rpm={lim.requests.rate_per_min:g}, tpm={lim.tokens.rate_per_min:g})",
                max(wait_req, wait_tok),
            )
        lim.requests.level -= 1.0
        lim.tokens.level -= reserve
        return int(reserve)

    def settle(self, key: str, reserved: int, used: int) -> None:
        """Replace the reservation with the tokens actually used (may leave the bucket negative)."""
        lim = self._keys.get(key)
        if lim is not None:
            lim.tokens.level += reserved - used

    def refund_request(self, key: str) -> None:
        """Give back the request ``admit`` took (the request was refused later on)."""
        lim = self._keys.get(key)
        if lim is not None:
            lim.requests.level = min(lim.requests.rate_per_min, lim.requests.level + 1.0)

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < IDLE_FORGET_S:
            return
        self._last_sweep = now
        for k in [k for k, v in self._keys.items() if now - v.requests.at > IDLE_FORGET_S]:
            del self._keys[k]
