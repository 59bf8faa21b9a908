"""Incremental detokenization with stop strings.

One :class:`IncrementalDetokenizer` per sequence, fed by the engine after each sampled token.
Two guarantees:

- it never emits half a UTF-8 character: text that still ends in U+FFFD (an incomplete byte
  sequence) is held back until the next token completes it;
- the concatenation of everything it emits equals ``tokenizer.decode(output_ids,
  skip_special_tokens=True)`` — each delta is the difference between decoding a short window
  of tokens with and without the new ones, so leading-space rules (SentencePiece ``▁``,
  byte-level ``Ġ``) apply exactly as in a whole decode, and :meth:`finish` reconciles against
  one whole decode at the end.

Stop strings (OpenAI semantics): the output ends *before* the first occurrence of any stop
string, which is not emitted; text that could still become a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Tokens decoded before the unread ones, so the new text is decoded in context.
CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas for one sequence."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        # Window: tokens [prefix_offset, read_offset) are decoded context already turned into
        # text; tokens from read_offset on have not produced text yet.
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded text so far (emitted + held back)
        self.num_emitted_chars = 0  # len of text already returned to the caller
        self.stopped = False  # a stop string was found; no more text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Add newly sampled tokens; returns the text that can be emitted now ("" if none).
        After a stop string is found (:attr:`stopped`), returns "" forever."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = max(self.read_offset, len(self.token_ids) - CONTEXT_TOKENS)
            self.read_offset = len(self.token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The sequence ended: the rest of the text (incomplete characters decode as U+FFFD,
        as a whole decode would). Reconciles with one whole decode of the output."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            self.text = full
        else:  # pragma: no cover - defensive: windowed decoding disagreed with a whole decode
            self.text += full[len(self.text) :] if len(full) > len(self.text) else ""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        """Text past ``num_emitted_chars`` that is safe to emit, minding stop strings."""
        end = len(self.text)
        if self.stop:
            # Search only where a new match can start: max stop length back from the unread text.
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.num_emitted_chars - longest + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                # Held-back text guarantees a match never starts inside emitted text.
                end = max(min(hits), self.num_emitted_chars)
                self.stopped = True
                self.text = self.text[:end]
            elif not final:
                end -= _held_back(self.text, self.stop, self.num_emitted_chars)
        if end <= self.num_emitted_chars:
            return ""
        out = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return out


def _held_back(text: str, stops: list[str], start: int) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of a stop."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - start), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
