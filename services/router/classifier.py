"""Difficulty classification: a transparent score with its reasons.

The router calls ``Classifier.classify`` for requests whose model is ``auto``; a score at or above
``router.large_threshold`` sends the request to the large pool. The default,
``HeuristicClassifier``, adds one documented amount per factor that fires (weights and thresholds
are ``router.classifier`` settings). A learned classifier implements the same ``Classifier``
protocol — typically on the same ``features(req)`` — and is named in settings as
``router.classifier.kind = "package.module:factory"`` (``factory(settings) -> Classifier``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

from libs.protocol import GenerateRequest
from libs.settings import ClassifierSettings, Settings

# Markers, matched on lower-cased text by substring and whole-word tests (a regex alternation
# over a few KB of prompt costs ~0.5 ms in Python; these cost tens of microseconds).
_CODE_SUBSTRINGS = ("```", "#include", "=>", ";\n", "function(", "select ")
_CODE_RE = re.compile(r"\bdef \w+\(|\bclass \w+[:(]")
_MATH_WORDS = frozenset(
    {"prove", "proof", "integral", "derivative", "equation", "theorem", "lemma", "matrix"}
)
_MATH_SUBSTRINGS = ("solve for", "∑", "∫", "√", "≤", "≥")
_MATH_RE = re.compile(r"\d\s?[\^*/]\s?\d")
_MULTI_STEP_WORDS = frozenset({"compare", "analyze", "analyse", "plan", "design"})
_MULTI_STEP_SUBSTRINGS = ("step by step", "first,", "then,", "finally,", "explain why")
_PUNCT = ".,;:!?()[]{}\"'`"

# Characters per token for a rough prompt length when only text is known.
CHARS_PER_TOKEN = 4


@dataclass
class Difficulty:
    score: float
    factors: list[str] = field(default_factory=list)


class Classifier(Protocol):
    def classify(self, req: GenerateRequest) -> Difficulty: ...


@dataclass(slots=True)
class Features:
    """What the heuristic looks at; a learned classifier can take the same inputs."""

    prompt_chars: int
    max_tokens: int
    code: bool
    math: bool
    multi_step: bool
    turns: int


def prompt_text(req: GenerateRequest) -> str:
    if req.messages:
        return "\n".join(m.content for m in req.messages)
    return req.prompt or ""


@lru_cache(maxsize=4096)
def markers(text: str) -> tuple[bool, bool, bool]:
    """(code, math, multi_step) in ``text``; cached, so a conversation's earlier turns and a
    shared system prompt are scanned once."""
    low = text.lower()
    words = {w.strip(_PUNCT) for w in low.split()}
    code = any(m in low for m in _CODE_SUBSTRINGS) or low.rstrip().endswith(";")
    if not code and ("def " in low or "class " in low):
        code = _CODE_RE.search(low) is not None
    math = not _MATH_WORDS.isdisjoint(words) or any(m in low for m in _MATH_SUBSTRINGS)
    if not math and ("^" in low or "*" in low or "/" in low):
        math = _MATH_RE.search(low) is not None
    multi = not _MULTI_STEP_WORDS.isdisjoint(words) or any(m in low for m in _MULTI_STEP_SUBSTRINGS)
    return code, math, multi


def features(req: GenerateRequest) -> Features:
    if req.messages:
        texts = [m.content for m in req.messages]
    else:
        texts = [req.prompt or ""]
    n_chars = sum(map(len, texts)) + max(len(texts) - 1, 0)
    if req.prompt_token_ids is not None:
        n_chars = CHARS_PER_TOKEN * len(req.prompt_token_ids)
    found = [markers(t) for t in texts]
    return Features(
        prompt_chars=n_chars,
        max_tokens=req.sampling.max_tokens,
        code=any(f[0] for f in found),
        math=any(f[1] for f in found),
        multi_step=any(f[2] for f in found),
        turns=len(req.messages or ()),
    )


class HeuristicClassifier:
    def __init__(self, weights: ClassifierSettings | None = None) -> None:
        self.w = weights or ClassifierSettings()

    def classify(self, req: GenerateRequest) -> Difficulty:
        w, f = self.w, features(req)
        fired = [
            (f.prompt_chars >= w.long_prompt_chars, w.long_prompt, "long_prompt"),
            (f.max_tokens >= w.long_output_tokens, w.long_output, "long_output"),
            (f.code, w.code, "code"),
            (f.math, w.math, "math"),
            (f.multi_step, w.multi_step, "multi_step"),
            (f.turns >= w.deep_conversation_turns, w.deep_conversation, "deep_conversation"),
        ]
        score = sum(amount for hit, amount, _ in fired if hit)
        return Difficulty(round(score, 3), [name for hit, _, name in fired if hit])


def build_classifier(settings: Settings) -> Classifier:
    """The classifier ``router.classifier.kind`` names."""
    kind = settings.router.classifier.kind
    if kind == "heuristic":
        return HeuristicClassifier(settings.router.classifier)
    module, sep, attr = kind.partition(":")
    if not sep:
        raise ValueError(
            f"router.classifier.kind must be 'heuristic' or 'module:factory', got {kind!r}"
        )
    factory = getattr(importlib.import_module(module), attr)
    clf: Classifier = factory(settings)
    return clf
