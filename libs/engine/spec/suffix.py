"""Suffix lookup across requests (``speculative.method = "suffix"``): when a sequence's own
prompt and output hold no match for its tail, propose what followed that tail in the recent
outputs of the worker's other requests (agents and templated answers repeat themselves).

One :class:`SuffixCache` per engine, fed by the engine with each finished sequence's output
(verified tokens only). Bounded: at most ``suffix_cache_tokens`` tokens are kept; the oldest
output is dropped first, with the index entries that still point into it.
"""

from __future__ import annotations

from libs.engine.spec.ngram import NgramIndex


class SuffixCache:
    """Recent outputs of finished sequences, indexed by n-gram (``min_n..max_n`` tokens)."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.max_tokens = max_tokens
        self._outputs: dict[int, tuple[int, ...]] = {}  # id → tokens, oldest first
        # n-gram → (output id, end position in it) of its newest copy.
        self._last: dict[tuple[int, ...], tuple[int, int]] = {}
        self._next_id = 0
        self.num_tokens = 0

    def add(self, output: list[int]) -> None:
        """Keep one finished output; its n-grams that some token follows are indexed."""
        if len(output) <= self.min_n or self.max_tokens <= 0:
            return
        tokens = tuple(output[-self.max_tokens :])
        oid = self._next_id
        self._next_id += 1
        self._outputs[oid] = tokens
        self.num_tokens += len(tokens)
        for i in range(len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self._last[tokens[i - n + 1 : i + 1]] = (oid, i)
        while self.num_tokens > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        oid = next(iter(self._outputs))
        tokens = self._outputs.pop(oid)
        self.num_tokens -= len(tokens)
        for i in range(len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                key = tokens[i - n + 1 : i + 1]
                if self._last.get(key, (None, 0))[0] == oid:
                    del self._last[key]

    def find(self, tail: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram equal to the end of ``tail``."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            hit = self._last.get(tuple(tail[len(tail) - n :]))
            if hit is not None:
                oid, end = hit
                return list(self._outputs[oid][end + 1 : end + 1 + k])
        return []


__all__ = ["NgramIndex", "SuffixCache"]
