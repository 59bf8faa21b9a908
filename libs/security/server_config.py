"""The nats-server configuration of a secured fleet (``strait up --secure``, and the tests).

Accounts (nats-server's isolation unit: no subject crosses an account boundary unless one
account exports it and the other imports it):

- ``STRAIT`` holds every fleet process (one user, the fleet's nkey) and JetStream. For each
  active team it exports exactly four things, to that team's account only:
  service ``<p>.requests.<team>``, service ``<p>.cancel.<team>.*``, service
  ``<p>.resend.<team>.*`` and stream ``<p>.stream.<team>.*``.
- ``TEAM_<team>`` holds the team's user (its nkey) and imports those four under the fleet's
  plain names (``<p>.requests``, ``<p>.cancel.*``, ``<p>.resend.*``, ``<p>.stream.*``). Its
  user may publish only on the three service subjects and subscribe only to ``<p>.stream.*``
  and ``_INBOX.>`` (JetStream's publish acks): anything else is a permissions violation.

So a team publishes a request on ``<p>.requests``, the fleet receives it on
``<p>.requests.<team>`` (the server wrote the team, not the sender), and the router sends the
tokens to ``<p>.stream.<team>.<id>``, which only that team imports. A revoked team is left out;
reloading the server closes its connections at once.

A *staged* team's account is written with its imports and no user (nobody can log in to it).
nats-server (2.15.1 and before) does not subscribe the service imports of an account that a
config reload creates (``configureAccounts`` skips them while reloading; a later reload, which
finds the account existing, does). So ``SecureFleet.apply`` introduces a new team's account
staged first, and lets its user in with the next reload (decision 0020).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from libs.protocol import Subjects
from libs.security.teams import Team
from libs.security.tls import TlsFiles

FLEET_ACCOUNT = "STRAIT"
TLS_HANDSHAKE_TIMEOUT_S = 2.0


def team_account(team: str) -> str:
    return f"TEAM_{team}"


@dataclass(frozen=True)
class TeamGrants:
    """What one team's account gets from the fleet's, as (fleet subject, team subject)."""

    services: list[tuple[str, str]]
    streams: list[tuple[str, str]]
    publish: list[str]
    subscribe: list[str]


def grants(prefix: str, team: str) -> TeamGrants:
    s = Subjects(prefix)
    services = [
        (s.team_requests(team), s.requests),
        (f"{prefix}.cancel.{team}.*", f"{prefix}.cancel.*"),
        (f"{prefix}.resend.{team}.*", f"{prefix}.resend.*"),
    ]
    streams = [(f"{prefix}.stream.{team}.*", f"{prefix}.stream.*")]
    return TeamGrants(
        services=services,
        streams=streams,
        publish=[local for _, local in services],
        subscribe=[f"{prefix}.stream.*", "_INBOX.>"],
    )


def _q(value: str | Path) -> str:
    return json.dumps(str(value))


def _team_account(prefix: str, team: Team, staged: bool, exports: list[str]) -> list[str]:
    """The account block of one active ``team`` (``render``, per team): its imports of the
    fleet's services and streams, whose exports it appends to ``exports``, and its user (none
    while ``staged``)."""
    g, acc = grants(prefix, team.name), team_account(team.name)
    imports: list[str] = []
    for kind, pairs in (("service", g.services), ("stream", g.streams)):
        for remote, local in pairs:
            exports.append(f"      {{{kind}: {_q(remote)}, accounts: [{_q(acc)}]}}")
            imports.append(
                f"      {{{kind}: {{account: {FLEET_ACCOUNT}, subject: {_q(remote)}}}, "
                f"to: {_q(local)}}}"
            )
    pub = ", ".join(_q(x) for x in g.publish)
    sub = ", ".join(_q(x) for x in g.subscribe)
    users = (
        ["    users: []"]
        if staged
        else [
            f"    users: [{{nkey: {_q(team.public_key)}, permissions: {{",
            f"      publish: {{allow: [{pub}]}}",
            f"      subscribe: {{allow: [{sub}]}}",
            "    }}]",
        ]
    )
    return [f"  {_q(acc)}: {{", *users, "    imports: [", *imports, "    ]", "  }"]


def render(
    *,
    prefix: str,
    fleet_public_key: str,
    teams: list[Team],
    listen: str,
    max_payload: int,
    store_dir: str | Path,
    tls: TlsFiles | None = None,
    pid_file: str | Path | None = None,
    monitor: str = "",
    staged: frozenset[str] = frozenset(),
) -> str:
    """nats-server's configuration text for the fleet and its active ``teams``; the accounts
    of ``staged`` teams have no user yet. ``monitor``: host:port of the server's monitoring
    endpoint (``SecureFleet.apply`` reads it), none when empty."""
    active = [t for t in teams if t.active]
    lines = [
        f"listen: {_q(listen)}",
        f"max_payload: {max_payload}",
        f"jetstream {{ store_dir: {_q(store_dir)} }}",
    ]
    if pid_file is not None:
        lines.append(f"pid_file: {_q(pid_file)}")
    if monitor:
        lines.append(f"http: {_q(monitor)}")
    if tls is not None:
        lines += [
            "tls {",
            f"  cert_file: {_q(tls.cert)}",
            f"  key_file: {_q(tls.key)}",
            f"  ca_file: {_q(tls.ca)}",
            f"  timeout: {TLS_HANDSHAKE_TIMEOUT_S}",
            "}",
        ]
    exports: list[str] = []
    accounts: list[str] = []
    for t in active:
        accounts += _team_account(prefix, t, t.name in staged, exports)
    lines += [
        "accounts {",
        f"  {FLEET_ACCOUNT}: {{",
        "    jetstream: enabled",
        f"    users: [{{nkey: {_q(fleet_public_key)}}}]",
        "    exports: [",
        *exports,
        "    ]",
        "  }",
        *accounts,
        "}",
    ]
    return "\n".join(lines) + "\n"
