"""What a step costs, fitted as the engine runs, and the prefill budget it implies.

The engine times every forward and calls :meth:`StepCostModel.observe`; the scheduler asks
:meth:`StepCostModel.prefill_budget` how many prompt tokens the next step may carry so that it
stays under the pool's inter-token target (``engine.itl_target_ms``); speculation asks the
decode fit when proposing pays (``libs.engine.spec``).

Model, in seconds: ``a + b * rows + c * prefill_tokens + d * prefill_work``, where ``rows``
are the step's decode rows (decoding sequences plus their proposals) and ``prefill_work`` the
(query, earlier key) pairs its prompt chunks attend over, ``P * start + P * (P - 1) / 2`` for
a chunk of ``P`` tokens from position ``start``: a long prompt's late chunks cost more.
``(a, b)`` is an exponentially weighted least squares fit over decode-only steps
(:class:`StepCost`); ``(c, d)`` one over what mixed steps took beyond the decode fit, both
held non-negative; before the mixed steps separate them, ``c`` alone (a per-token mean). The
budget aims a mixed step at the target over ``overrun``, the tracked 90th percentile of what
mixed steps took against their prediction (at least 1): a fit is right on average, and a step
filled to the target by an average would go over it half the time. Same on CUDA: the fit sees
the device's step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STEP_COST_DECAY = 0.99  # weight of a step in the decode fit, per later step
STEP_COST_MIN_STEPS = 16  # decode steps before the fit is used
PREFILL_COST_WEIGHT = 0.05  # weight of one mixed step in the per-token prefill cost
PREFILL_MIN_SAMPLE_TOKENS = 8  # mixed steps with fewer prompt tokens say too little about c
PREFILL_MIN_STEPS = 4  # mixed steps before the prefill cost is used
# The budget aims the step's prediction at the target divided by this quantile of what mixed
# steps took over what was predicted for them (tracked as they run), so that all but the
# slowest (1 - OVERRUN_QUANTILE) of them stay under the target, not half of them.
OVERRUN_QUANTILE = 0.9
OVERRUN_RATE = 0.02  # step size of the quantile's tracking, per mixed step
OVERRUN_MAX = 3.0  # a bound on the correction (a machine stalled for a while must not stop prefill)


class StepCost:
    """The engine's decode forward time as ``a + b * rows`` (seconds; rows = decoding sequences
    plus their proposals), fitted by exponentially weighted least squares over recent decode
    steps. Speculation pays for a sequence when its acceptance rate exceeds
    ``b * B / (a + b * B)`` with ``B`` sequences decoding: each proposal costs ``b``, and each
    kept one is a token the batch got without a step."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.steps = 0

    def add(self, rows: int, seconds: float) -> None:
        d = STEP_COST_DECAY
        self.n = d * self.n + 1
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0, or None before enough decode steps of at least two sizes. A
        step cannot cost less than nothing: when the free fit's intercept or slope comes out
        negative (steps of few distinct sizes on a noisy machine), that term is held at 0 and
        the other fitted alone (non-negative least squares)."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.steps < STEP_COST_MIN_STEPS or var <= 1e-9 * self.n * self.n:
            return None
        b = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - b * self.sx) / self.n
        if a < 0:
            return 0.0, max(self.sxy / self.sxx, 0.0)
        if b < 0:
            return self.sy / self.n, 0.0
        return a, b

    def predict(self, rows: int) -> float | None:
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * rows

    def break_even(self, batch: int) -> float:
        """Acceptance rate above which proposing pays with ``batch`` sequences decoding."""
        ab = self.fit()
        if ab is None or batch <= 0:
            return 0.0
        a, b = ab
        if b <= 0:
            return 0.0
        return b * batch / (a + b * batch)  # > 0: b > 0 and batch > 0


@dataclass(frozen=True, slots=True)
class PrefillBudget:
    """The scheduler's allowance of prompt tokens for one step, and why."""

    tokens: int
    # "" (within the target) | "decode_rows" (decode alone is predicted over the target)
    # | "prefill_floor" (the floor of prompt tokens takes the step over it)
    over_target: str = ""


class StepCostModel:
    """The decode fit plus the per-prompt-token cost; owned by the engine."""

    def __init__(self) -> None:
        self.decode = StepCost()
        self.per_prefill_token = 0.0  # seconds, EW mean over mixed steps
        self.prefill_steps = 0
        # EW sums of the mixed steps' (P, W, excess) products, for the (c, d) fit.
        self.spp = self.spw = self.sww = self.spy = self.swy = 0.0
        # OVERRUN_QUANTILE of (mixed step's seconds / its prediction), at least 1.
        self.overrun = 1.0

    def observe(
        self, rows: int, prefill_tokens: int, seconds: float, prefill_work: float = 0.0
    ) -> None:
        """One step of ``rows`` decode rows and ``prefill_tokens`` prompt tokens attending
        over ``prefill_work`` (query, earlier key) pairs (``SchedulerOutput.prefill_work``)."""
        if prefill_tokens == 0:
            self.decode.add(rows, seconds)
            return
        base = self.decode.predict(rows)
        if base is None or prefill_tokens < PREFILL_MIN_SAMPLE_TOKENS:
            return
        if self.ready():
            c, d = self.prefill_fit()
            predicted = base + c * prefill_tokens + d * prefill_work
            if predicted > 0:
                # Tracks the quantile: up by q*rate on a step over it, down by (1-q)*rate below.
                over = seconds / predicted > self.overrun
                step = OVERRUN_QUANTILE if over else OVERRUN_QUANTILE - 1.0
                self.overrun = min(max(self.overrun + OVERRUN_RATE * step, 1.0), OVERRUN_MAX)
        excess = max(seconds - base, 0.0)
        w = 1.0 if self.prefill_steps == 0 else PREFILL_COST_WEIGHT
        self.per_prefill_token += w * (excess / prefill_tokens - self.per_prefill_token)
        self.prefill_steps += 1
        d, p, q = STEP_COST_DECAY, float(prefill_tokens), prefill_work
        self.spp, self.spw, self.sww = (
            d * self.spp + p * p,
            d * self.spw + p * q,
            d * self.sww + q * q,
        )
        self.spy, self.swy = d * self.spy + p * excess, d * self.swy + q * excess

    def prefill_fit(self) -> tuple[float, float]:
        """(c, d): seconds per prompt token and per attended pair, both >= 0; (mean, 0) while
        the mixed steps seen do not separate the two."""
        det = self.spp * self.sww - self.spw * self.spw
        if det <= 1e-9 * self.spp * self.sww or self.sww <= 0:
            return self.per_prefill_token, 0.0
        c = (self.spy * self.sww - self.swy * self.spw) / det
        d = (self.swy * self.spp - self.spy * self.spw) / det
        if d < 0:
            return max(self.spy / self.spp, 0.0), 0.0
        if c < 0:
            return 0.0, max(self.swy / self.sww, 0.0)
        return c, d

    def ready(self) -> bool:
        return self.decode.fit() is not None and self.prefill_steps >= PREFILL_MIN_STEPS

    def prefill_budget(
        self, target_s: float, rows: int, floor: int, ceiling: int, start: int = 0
    ) -> PrefillBudget | None:
        """Prompt tokens a step with ``rows`` decode rows may carry to stay under
        ``target_s`` when its prompt tokens start at position ``start``: at least ``floor``
        (prompts always progress), at most ``ceiling``; None until the model has seen enough
        steps (the scheduler then uses its fixed chunks). A step with no decode row keeps no
        stream waiting: it takes ``ceiling`` (TTFT)."""
        if not self.ready():
            return None
        if rows == 0:
            return PrefillBudget(ceiling)
        decode_s = self.decode.predict(rows)
        assert decode_s is not None  # ready() implies a fit
        room = target_s / self.overrun - decode_s
        if room <= 0:
            return PrefillBudget(max(min(floor, ceiling), 0), "decode_rows")
        c, d = self.prefill_fit()
        # c * P + d * (P * start + P * P / 2) <= room, for the largest P.
        lin = c + d * start
        if d > 0:
            p = (-lin + math.sqrt(lin * lin + 2 * d * room)) / d
        else:
            p = room / lin if lin > 0 else float(ceiling)
        tokens = min(int(p), ceiling)
        if tokens < floor:
            return PrefillBudget(max(min(floor, ceiling), 0), "prefill_floor")
        return PrefillBudget(tokens)
