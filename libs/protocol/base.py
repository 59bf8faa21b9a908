"""The base of every wire type, the protocol's version, and the names the wire carries in
subjects: request ids, request keys, team names.

Part of the wire protocol (``libs.protocol``, which re-exports every name).
"""

from __future__ import annotations

import re

import msgspec

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})


class Struct(msgspec.Struct, forbid_unknown_fields=False):
    """Base for wire types: unknown fields are ignored (forward compatible within a version)."""


MAX_REQUEST_ID_CHARS = 128
# A team name is a subject token and part of a NATS account name.
TEAM_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def request_key(origin: str | None, request_id: str) -> str:
    """The fleet's key of a request: its id, or ``<team>.<id>`` for a team account's request.
    Unambiguous: request ids hold no ``.`` (``usable_request_id``) and team names none."""
    return request_id if origin is None else f"{origin}.{request_id}"


def valid_team(name: str) -> bool:
    return TEAM_NAME.fullmatch(name) is not None


def usable_request_id(rid: str) -> bool:
    """True when ``rid`` can name a stream subject: 1..128 characters, none of ``. * >`` and no
    whitespace. Anything else is never answered on ``stream.<rid>`` (it would be another
    subject, a wildcard, or a protocol line nats-server refuses), only dead-lettered."""
    return 0 < len(rid) <= MAX_REQUEST_ID_CHARS and not any(c in ".*>" or c.isspace() for c in rid)
