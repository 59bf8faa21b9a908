"""The difficulty classifier: factors, weights from settings, the learned-classifier hook."""

from __future__ import annotations

import pytest

from libs.protocol import GenerateRequest
from libs.settings import ClassifierSettings, Settings
from services.router.classifier import (
    Difficulty,
    HeuristicClassifier,
    build_classifier,
    features,
)
from tests.unit.router.helpers import request

pytestmark = pytest.mark.unit


def classify(req: GenerateRequest, **weights: float) -> Difficulty:
    return HeuristicClassifier(ClassifierSettings(**weights)).classify(req)  # type: ignore[arg-type]


def test_a_short_plain_question_scores_zero() -> None:
    assert classify(request("What is the capital of France?")) == Difficulty(0.0, [])


@pytest.mark.parametrize(
    ("prompt", "factor", "score"),
    [
        ("```python\nprint(1)\n```", "code", 0.6),
        ("def add(a, b):\n    return a + b", "code", 0.6),
        ("Prove that the integral of x is x^2/2", "math", 0.6),
        ("Explain why the sky is blue", "multi_step", 0.4),
    ],
)
def test_each_marker_adds_its_weight(prompt: str, factor: str, score: float) -> None:
    d = classify(request(prompt))
    assert d.factors == [factor] and d.score == score


def test_lengths_and_depth_are_factors() -> None:
    long_prompt = request("word " * 500, max_tokens=1024)
    assert classify(long_prompt) == Difficulty(1.0, ["long_prompt", "long_output"])
    turns = [("user", "hi"), ("assistant", "hello")] * 3
    assert classify(request(messages=turns)).factors == ["deep_conversation"]


def test_token_id_prompts_are_measured_in_tokens() -> None:
    req = GenerateRequest(request_id="t", prompt_token_ids=list(range(600)))
    assert features(req).prompt_chars == 2400
    assert classify(req).factors == ["long_prompt"]


def test_weights_and_thresholds_come_from_settings() -> None:
    req = request("Let us compare two approaches step by step")
    assert classify(req, multi_step=1.5).score == 1.5
    s = Settings()
    s.router.classifier.multi_step = 2.0
    assert build_classifier(s).classify(req).score == 2.0


class ConstantClassifier:
    def __init__(self, settings: Settings) -> None:
        self.score = settings.router.large_threshold

    def classify(self, req: GenerateRequest) -> Difficulty:
        return Difficulty(self.score, ["learned"])


def test_a_learned_classifier_is_named_by_import_path() -> None:
    s = Settings()
    s.router.classifier.kind = f"{__name__}:ConstantClassifier"
    assert build_classifier(s).classify(request("hi")) == Difficulty(1.0, ["learned"])
    s.router.classifier.kind = "nonsense"
    with pytest.raises(ValueError, match="module:factory"):
        build_classifier(s)
