"""The base of every settings section written with field docstrings.

A field's docstring (the string right under it) is its description: libs/settings/reference.py
reads them from the source to render docs/settings.md, and tests/unit/settings holds every
``Section`` field to having one. They are not read at run time, so they cost a process nothing.
"""

from __future__ import annotations

from pydantic import BaseModel


class Section(BaseModel):
    """One ``[section]`` of the settings file (or one table inside one)."""
