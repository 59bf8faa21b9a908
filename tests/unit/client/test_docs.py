"""docs/nats-api.md and docs/schemas/ match what the protocol module generates."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import get_args

import pytest

from libs.client.docs import ERRORS, SUBJECTS, render_reference
from libs.protocol import ErrorCode

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_generated_docs_and_schemas_are_fresh() -> None:
    gen = runpy.run_path(str(ROOT / "docs" / "gen_nats_api.py"))
    stale = [
        str(p.relative_to(ROOT)) for p, text in gen["expected"]().items() if p.read_text() != text
    ]
    assert not stale, f"stale, run `.venv/bin/python docs/gen_nats_api.py`: {stale}"


def test_reference_covers_every_subject_and_error_code() -> None:
    text = render_reference()
    assert set(get_args(ErrorCode)) == ERRORS.keys()
    assert all(f"`Subjects.{name}" in text for name in SUBJECTS)
    assert "`strait.v1.events.route`" in text and "`STRAIT_EVENTS`" in text
