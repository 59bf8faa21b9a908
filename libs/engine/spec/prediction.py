"""Predicted outputs (OpenAI's ``prediction``): propose what follows the sequence's tail in the
text the request said its answer would repeat (the code being edited, a document being
revised).

One :class:`PredictionIndex` per sequence with a prediction (``Sequence.prediction_index``),
built on its first proposal: every n-gram of the prediction (``min_n <= n <= max_n``) → the
positions where it ends, in order. A lookup takes the longest n-gram of the tail found there
and prefers its first copy at or after the cursor (just past the last match): an edited
answer walks through its prediction in order, so a repeated line is matched where the answer
is, not where it last appeared.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class PredictionIndex:
    __slots__ = ("_ends", "cursor", "doc", "max_n", "min_n")

    def __init__(self, doc: Sequence[int], min_n: int, max_n: int) -> None:
        self.doc = list(doc)
        self.min_n, self.max_n = min_n, max_n
        self.cursor = 0  # prefer matches ending at or after this position
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram → end positions, ascending
        for i in range(len(self.doc)):
            for n in range(min_n, min(max_n, i + 1) + 1):
                self._ends.setdefault(tuple(self.doc[i - n + 1 : i + 1]), []).append(i)

    def find(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction that follow the longest n-gram of ``tokens``'
        tail found in it (none when no n-gram is, or nothing follows it)."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if not ends:
                continue
            i = bisect_left(ends, self.cursor)
            end = ends[i] if i < len(ends) else ends[-1]
            proposal = self.doc[end + 1 : end + 1 + k]
            if proposal:
                self.cursor = end + 1
                return proposal
        return []
