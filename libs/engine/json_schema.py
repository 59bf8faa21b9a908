"""JSON schemas as the grammar engine is given them: what users of OpenAI, vLLM and llama.cpp
expect a schema to mean, where JSON Schema's own defaults would let a small model write forever.

:func:`for_grammar` rewrites a request's schema (a copy) before llguidance compiles it
(``libs.engine.structured``, and the tool-call grammars of ``libs.engine.tools``):

- **closed objects**: an object schema that lists ``properties`` and says nothing of
  ``additionalProperties`` admits no others (``additionalProperties: false``), as OpenAI's
  structured outputs and vLLM's default grammar read it. JSON Schema's default (any other
  property) let SmolLM2 write ``"population_density": …, "population_per_capita": …`` until
  ``max_tokens``. Not applied to the branches of an ``allOf`` of several schemas (closing each
  would forbid the others' properties).
- **bounded numbers**: an ``integer`` or ``number`` with no ``maximum`` / ``minimum`` gets
  ``±(10^d − 1)``, ``d`` = ``max_integer_digits`` (llama.cpp's grammar: 16 digits); a
  ``number`` without ``multipleOf`` gets ``10^-f``, ``f`` = ``max_fraction_digits``, so its
  fraction ends too and it is never written with an exponent.
- **ASCII classes** in ``pattern``: ``\\d``, ``\\w``, ``\\s`` (as ``ascii_classes`` lists them)
  mean ``[0-9]``, ``[0-9a-zA-Z_]``, ``[ \\t\\n\\r\\f\\v]`` (JavaScript's and Python's byte
  semantics; the grammar engine reads ``\\s`` as any Unicode space). :func:`ascii_regex` does
  the same to a whole-answer regex.

No torch here: ``libs.engine.tools`` (imported by the gateway) uses it.
"""

from __future__ import annotations

from typing import Any

from libs.engine.config import StructuredSettings

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def ascii_regex(regex: str, rules: StructuredSettings) -> str:
    """``regex`` with the classes of ``rules.ascii_classes`` spelled as ASCII sets (escaped for
    a Lark ``/.../`` terminal, which is still a valid regex)."""
    import llguidance

    return str(llguidance.regex_to_lark(regex, rules.ascii_classes))


def for_grammar(schema: Any, rules: StructuredSettings, *, closable: bool = True) -> Any:
    """A copy of ``schema`` with the rules above (``schema`` is not changed).

    ``closable``: whether an object schema here may be closed (False for an ``allOf``'s
    branches)."""
    if isinstance(schema, list):  # draft-04 tuple ``items``
        return [for_grammar(s, rules) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    out: dict[str, Any] = dict(schema)
    for key in _ONE:
        if key in out and isinstance(out[key], dict | list):
            out[key] = for_grammar(out[key], rules)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [for_grammar(s, rules) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        several = len(out["allOf"]) > 1
        out["allOf"] = [for_grammar(s, rules, closable=not several) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: for_grammar(s, rules) for name, s in out[key].items()}
    if (
        rules.closed_objects
        and closable
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    types = out.get("type")
    kinds = set(types) if isinstance(types, list) else {types}
    if kinds & {"integer", "number"}:
        _bound_number(out, rules, integer="number" not in kinds)
    if isinstance(out.get("pattern"), str) and rules.ascii_classes:
        out["pattern"] = ascii_regex(out["pattern"], rules)
    return out


def _bound_number(out: dict[str, Any], rules: StructuredSettings, *, integer: bool) -> None:
    """Bound the digits of a number schema that leaves them open (in place)."""
    largest = 10**rules.max_integer_digits - 1
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = largest
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -largest
    if not integer and "multipleOf" not in out:
        out["multipleOf"] = float(f"1e-{rules.max_fraction_digits}")
