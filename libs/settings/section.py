"""The base of every settings section: a field's docstring is its description.

``libs/settings/reference.py`` renders those descriptions into docs/settings.md, so the
docstring under a field is the operator's reference for it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """One ``[section]`` of the settings file (or one table inside one)."""

    model_config = ConfigDict(use_attribute_docstrings=True)
