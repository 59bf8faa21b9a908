"""Issue 39's structured-output cases on the real model, greedy: output tokens, finish reason
and text of each, before ``engine.structured``'s rules (the schema and regex as JSON Schema and
the grammar engine read them) and after.

Run: ``python -m bench.structured_cases`` (``--max-tokens``; the default model and engine
settings of ``configs/strait.toml``; ``STRAIT_ENGINE__COMPILE=false`` to skip compiling).
The cases: the schema ``{"name": string, "population": integer}`` with no
``additionalProperties``, a bare ``integer``, and the regex ``\\d{3}-\\d{4}``.
"""

from __future__ import annotations

import argparse
from typing import Any

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("city schema", "Describe Paris as JSON.", {"json": CITY}),
    ("bare integer", "How many people live in Paris?", {"json": {"type": "integer"}}),
    ("regex \\d{3}-\\d{4}", "Give me a phone number.", {"regex": r"\d{3}-\d{4}"}),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured_cases", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from libs.engine.engine import LLMEngine
    from libs.engine.loader import load_model
    from libs.models import prepare_model
    from libs.protocol import SamplingParams, StructuredOutput
    from libs.settings import get_settings

    settings = get_settings()
    path = prepare_model(args.model, settings)
    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    es = settings.engine
    engine = LLMEngine(load_model(path, es), tokenizer, es, args.model)
    assert engine.grammars is not None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print("| case | rules | tokens | finish | output |\n| --- | --- | --- | --- | --- |")
    for name, question, structured in CASES:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        for label in ("before", "after"):
            if label == "before":
                grammar = _unruled(structured)
            else:
                grammar = engine.grammars.compile(StructuredOutput(**structured), None)
            rid = f"{name}-{label}"
            engine.add_request(rid, list(prompt), params, grammar=grammar)
            text, tokens, reason = "", 0, None
            while engine.has_unfinished():
                for o in engine.step():
                    text += o.chunk.text
                    tokens += len(o.chunk.token_ids)
                    reason = o.chunk.finish_reason or reason
            shown = text if len(text) <= 90 else text[:87] + "..."
            print(f"| {name} | {label} | {tokens} | {reason} | `{shown!r}` |")
    return 0


def _unruled(structured: dict[str, Any]) -> str:
    """The grammar Strait compiled before the rules: the schema as given (with the layout),
    the regex as llguidance reads it."""
    import json

    import llguidance

    from libs.engine.tools import JSON_LAYOUT

    if "regex" in structured:
        return str(llguidance.grammar_from("regex", structured["regex"]))
    schema = {**structured["json"], "x-guidance": JSON_LAYOUT}
    return str(llguidance.grammar_from("json_schema", json.dumps(schema)))


if __name__ == "__main__":
    raise SystemExit(main())
