"""docs/settings.md matches what libs/settings/ renders, and covers every field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from libs.settings import Settings
from libs.settings.reference import DOC, _model_of, descriptions, main, render
from libs.settings.section import Section

pytestmark = pytest.mark.unit


def sections(model: type[BaseModel] = Settings) -> list[type[BaseModel]]:
    """Every settings class reachable from ``model``, ``model`` first."""
    found = [model]
    for field in model.model_fields.values():
        sub = _model_of(field.annotation)
        if sub is not None and sub not in found:
            found += [s for s in sections(sub) if s not in found]
    return found


def test_the_reference_is_fresh() -> None:
    assert DOC.read_text() == render(), (
        "docs/settings.md is stale: run `.venv/bin/python -m libs.settings.reference` "
        "(or `make settings-doc`)"
    )
    assert main(["--check"]) == 0


def test_every_field_of_every_section_is_listed_with_its_variable() -> None:
    text = render()
    assert "| `worker_ttl_s` | float | `1.5` | `STRAIT_FLEET__WORKER_TTL_S` |" in text
    assert "| `max_integer_digits` | int, ≥ 1, ≤ 18 | `16` |" in text
    assert "`STRAIT_ROUTER__CLASSIFIER__CODE`" in text
    assert "`STRAIT_POOLS__0__NAME`" not in text  # list items have no variable of their own
    for name, field in Settings.model_fields.items():
        if _model_of(field.annotation) is None:
            assert f"| `{name}` |" in text
        else:
            assert f"## `[{name}]`" in text or f"## `[[{name}]]`" in text
    for model in sections()[1:]:
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} missing"


def test_every_section_field_has_a_description() -> None:
    """Docstrings are the reference: a new field without one fails here. Sections still
    written with comments (the engine's) are read from their comments and not held to it."""
    missing = [
        f"{model.__name__}.{name}"
        for model in sections()
        if issubclass(model, Section) or model is Settings
        for name in model.model_fields
        if not descriptions(model).get(name)
    ]
    assert not missing


def test_descriptions_come_from_docstrings_else_comments() -> None:
    class Mixed(BaseModel):
        # Above the field,
        # on two lines.
        a: int = 1
        b: str = ""  # after it
        c: bool = False
        d: float = Field(default=0.5, ge=0)
        """Under the field,
        indented."""
        # A comment above a documented field is not its description.
        e: int = 0
        """Its docstring."""

    assert descriptions(Mixed) == {
        "a": "Above the field, on two lines.",
        "b": "after it",
        "d": "Under the field,\nindented.",
        "e": "Its docstring.",
    }


def test_a_stale_file_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "settings.md"
    stale.write_text(render().replace("`1.5`", "`9.9`"))
    monkeypatch.setattr("libs.settings.reference.DOC", stale)
    monkeypatch.setattr("libs.settings.reference.ROOT", tmp_path)
    assert main(["--check"]) == 1
    assert main([]) == 0 and stale.read_text() == render()
