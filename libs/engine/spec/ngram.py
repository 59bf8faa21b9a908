"""Prompt lookup (``speculative.method = "ngram"``): propose what followed the last time the
sequence's own tail appeared in its prompt or output.

One :class:`NgramIndex` per speculating sequence (``Sequence.spec_index``), built on its first
proposal and extended with each verified token afterwards; it only ever sees tokens that are in
``Sequence.token_ids`` (verified), never a proposal. Memory: one dict entry per token and per
n-gram length (``prompt_lookup_max - prompt_lookup_min + 1``).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of a token list last ended.

    ``find`` looks up the list's own tail among *earlier* positions: the entry of an n-gram
    ending at position ``i`` is added only once a later token exists, so a lookup never finds
    the tail itself."""

    __slots__ = ("_last", "indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._last: dict[tuple[int, ...], int] = {}  # n-gram → end position of its last copy
        self.indexed = 0  # n-grams ending before this position are in _last

    def extend(self, tokens: Sequence[int]) -> None:
        """Index every n-gram ending before ``len(tokens) - 1`` (the tail stays out)."""
        end = len(tokens) - 1
        last = self._last
        for i in range(self.indexed, end):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                last[tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)

    def find(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest indexed n-gram equal to the tail."""
        self.extend(tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self._last.get(tuple(tokens[size - n :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + k])
        return []
