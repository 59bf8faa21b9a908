"""Settings that moved: an old name in a settings file or a ``STRAIT_*`` variable still applies,
under its new name, with a deprecation warning logged once per process.

``root.Settings.settings_customise_sources`` wraps each source (constructor arguments, the
environment, the TOML file) in ``RenamingSource``, so an old name is moved within its own source
before the sources are merged: ``STRAIT_ROUTER__WORKER_TTL_S`` still beats the file's
``[fleet] worker_ttl_s``, as any variable beats the file. Within one source the new name wins.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import (
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

log = logging.getLogger(__name__)

# (old section, old field) -> (new section, new field).
RENAMED: dict[tuple[str, str], tuple[str, str]] = {
    ("router", "worker_ttl_s"): ("fleet", "worker_ttl_s"),
    ("router", "retry_after_s"): ("fleet", "retry_after_s"),
    ("router", "replace_lost"): ("fleet", "replace_lost"),
    ("gateway", "max_pool_queue"): ("gateway", "shed_queue_depth"),
    ("gateway", "retry_after_s"): ("gateway", "shed_retry_after_s"),
}

ENVIRONMENT = "in the environment"

# Old names already warned about in this process (the settings are often built more than once).
_warned: set[tuple[str, str]] = set()


def env_name(section: str, field: str) -> str:
    return f"STRAIT_{section.upper()}__{field.upper()}"


def move_renamed(data: dict[str, Any], origin: str = "in the arguments") -> dict[str, Any]:
    """``data`` (one source's nested dict) with every old name moved to its new one. Logs one
    warning per old name per process, naming where it was set (``origin``), the new key and
    its variable."""
    data = dict(data)  # the caller's dicts (constructor arguments) stay as they were
    for (old_sec, old_field), (new_sec, new_field) in RENAMED.items():
        section = data.get(old_sec)
        if not isinstance(section, dict) or old_field not in section:
            continue
        data[old_sec] = section = dict(section)
        value = section.pop(old_field)
        target = data.get(new_sec, {})
        # A section given as an object (Settings(fleet=FleetSettings(...))) is set as a whole.
        taken = not isinstance(target, dict) or new_field in target
        if not taken:
            data[new_sec] = {**target, new_field: value}
        if (old_sec, old_field) not in _warned:
            _warned.add((old_sec, old_field))
            log.warning(
                "setting %s.%s (%s) is deprecated: set %s.%s (%s)%s",
                old_sec,
                old_field,
                f"{env_name(old_sec, old_field)} {origin}" if origin == ENVIRONMENT else origin,
                new_sec,
                new_field,
                env_name(new_sec, new_field),
                f"; ignored, {new_sec}.{new_field} is set" if taken else "",
            )
    return data


class RenamingSource(PydanticBaseSettingsSource):
    """A settings source whose old names are moved to their new ones (``move_renamed``)."""

    def __init__(self, source: PydanticBaseSettingsSource) -> None:
        super().__init__(source.settings_cls)
        self.source = source
        self.origin = _origin(source)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.source.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return move_renamed(self.source(), self.origin)

    def __repr__(self) -> str:
        return f"RenamingSource({self.source!r})"


def _origin(source: PydanticBaseSettingsSource) -> str:
    """Where ``source``'s values come from, as a warning names it."""
    if isinstance(source, EnvSettingsSource):
        return ENVIRONMENT
    if isinstance(source, TomlConfigSettingsSource):
        files = source.toml_file_path
        return f"in {files}" if files else "in the settings file"
    return "in the arguments"
