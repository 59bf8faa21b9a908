"""Schemas and regexes read as vLLM and llama.cpp users expect (``libs.engine.json_schema``,
``engine.structured``): objects closed unless ``additionalProperties`` opens them, integers and
numbers that end, ``\\d`` ``\\w`` ``\\s`` as ASCII. Checked on the grammar a worker compiles,
through llguidance's matcher on the tiny byte-level tokenizer, and on a tiny model's answers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.support.tiny_models import tiny_tokenizer
from libs.engine.json_schema import for_grammar
from libs.engine.structured import Grammars
from libs.protocol import SamplingParams, StructuredOutput
from libs.settings import StructuredSettings
from tests.unit.engine.helpers import Submission, run_engine
from tests.unit.engine.test_structured import make_engine, prompts

pytestmark = pytest.mark.unit

# The issue's schema: no additionalProperties, a bare integer.
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
RULES = StructuredSettings()


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok):  # type: ignore[no-untyped-def]
    return Grammars(tok, len(tok), [tok.eos_token_id])


def accepts(grammars: Grammars, structured: StructuredOutput, text: str) -> bool:
    """Whether ``text`` is a whole answer under the constraint."""
    m = grammars.matcher(grammars.compile(structured, None) or "")
    ids = grammars.tokenizer.tokenize_str(text)
    return bool(m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting())


def test_an_object_without_additional_properties_admits_only_its_own(grammars) -> None:  # type: ignore[no-untyped-def]
    city = StructuredOutput(json=CITY)
    assert accepts(grammars, city, '{"name": "Paris", "population": 11}')
    assert not accepts(grammars, city, '{"name": "Paris", "population": 11, "density": 120}')
    opened = StructuredOutput(json={**CITY, "additionalProperties": True})
    assert accepts(grammars, opened, '{"name": "Paris", "population": 11, "density": 120}')
    nested = {"type": "object", "properties": {"city": CITY}, "required": ["city"]}
    both = '{"city": {"name": "Lima", "population": 9, "mayor": "x"}}'
    assert not accepts(grammars, StructuredOutput(json=nested), both)


def test_integers_and_numbers_end(grammars) -> None:  # type: ignore[no-untyped-def]
    city = StructuredOutput(json=CITY)
    digits = "9" * RULES.max_integer_digits
    assert accepts(grammars, city, f'{{"name": "x", "population": -{digits}}}')
    assert not accepts(grammars, city, f'{{"name": "x", "population": {digits}9}}')
    number = StructuredOutput(json={"type": "number"})
    fraction = "1" * RULES.max_fraction_digits
    assert accepts(grammars, number, f"3.{fraction}")
    assert not accepts(grammars, number, f"3.{fraction}1")
    assert not accepts(grammars, number, "3e400")
    # A schema's own bounds stand.
    wide = StructuredOutput(json={"type": "integer", "maximum": 10**18})
    assert accepts(grammars, wide, str(10**17))


def test_regex_and_pattern_classes_are_ascii(grammars) -> None:  # type: ignore[no-untyped-def]
    phone = StructuredOutput(regex=r"\d{3}-\d{4}")
    assert accepts(grammars, phone, "555-1234")
    assert not accepts(grammars, phone, "\U0001fbf8" * 3 + "-" + "\U0001fbf8" * 4)
    word = StructuredOutput(regex=r"\w+\s\w+")
    assert accepts(grammars, word, "ab_1 cd")
    assert not accepts(grammars, word, "ab\u00a0cd")  # a no-break space is not ASCII \s
    assert not accepts(grammars, word, "東京 ab")
    pattern = {"type": "string", "pattern": r"^\d+\s\d+$"}
    assert accepts(grammars, StructuredOutput(json=pattern), '"12 34"')
    assert not accepts(grammars, StructuredOutput(json=pattern), '"12\u00a034"')


def test_the_rules_are_knobs(tok) -> None:  # type: ignore[no-untyped-def]
    """``engine.structured`` off: JSON Schema's own readings."""
    rules = StructuredSettings(closed_objects=False, ascii_classes="")
    plain = Grammars(tok, len(tok), [tok.eos_token_id], rules)
    extra = '{"name": "Paris", "population": 11, "density": 120}'
    assert accepts(plain, StructuredOutput(json=CITY), extra)
    assert accepts(plain, StructuredOutput(regex=r"\d"), "\U0001fbf8")


def test_for_grammar_leaves_the_request_schema_and_allof_branches() -> None:
    schema = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    out = for_grammar(schema, RULES)
    assert all("additionalProperties" not in s for s in out["allOf"])
    city = json.loads(json.dumps(CITY))
    for_grammar(city, RULES)
    assert city == CITY
    defs = {"$defs": {"C": CITY}, "$ref": "#/$defs/C"}
    assert for_grammar(defs, RULES)["$defs"]["C"]["additionalProperties"] is False


def test_a_tiny_model_ends_the_city_schema_well_within_max_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    """At temperature 1 a random model writes more properties as long as the grammar lets it:
    read as JSON Schema reads it, most of 8 answers run to ``max_tokens``; under the rules every
    answer ends (``stop``) and validates."""
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=8)
    prompt = prompts(tok, 1)[0]
    ends = {}
    for closed in (True, False):
        engine = make_engine(tok)
        rules = StructuredSettings(closed_objects=closed)
        engine.grammars = Grammars(tok, len(tok), [tok.eos_token_id], rules)
        grammar = engine.grammars.compile(StructuredOutput(json=CITY), None)
        results = run_engine(engine, [Submission("a", prompt, sp, grammar=grammar)])
        ends[closed] = [results[("a", i)].finish_reason for i in range(sp.n)]
        if closed:
            for i in range(sp.n):
                closed_city = {**CITY, "additionalProperties": False}
                jsonschema.validate(json.loads(results[("a", i)].text), closed_city)
    assert ends[True] == ["stop"] * sp.n
    assert ends[False].count("length") >= sp.n // 2
