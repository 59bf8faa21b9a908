"""The teams file and team credentials, written by ``strait teams add|revoke`` and read by
``strait up --secure`` (server config) and the router (limits, revocations).

Layout under ``<state_dir>/secure`` (``secure_dir``)::

    teams.json        # TeamsFile: every team ever added, revoked ones kept with revoked_at
    fleet.nk          # the fleet's own user seed (every fleet process connects with it)
    teams/<name>.nk   # a team's user seed: handed to that team, never read by the fleet

Keys are NATS nkeys (ed25519) made and encoded by the maintained ``nkeys`` package; only
public keys go into the server's configuration. Seed files are written mode 0600.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import nacl.signing
import nkeys

from libs.protocol import Priority, valid_team


class Team(msgspec.Struct, kw_only=True):
    name: str
    public_key: str  # the team user's nkey ("U..."), as nats-server's config names it
    rpm: int | None = None  # requests per minute; None: teams.default_rpm
    tpm: int | None = None  # tokens per minute (prompt + output); None: teams.default_tpm
    # Flow control (docs/flow-control.md): the team's weight in the fair share of tokens, the
    # most of its requests that may wait for a pool (None: flow.max_waiting), and the best
    # band its requests may use (a better one asked for is served in this one).
    weight: float = 1.0
    max_waiting: int | None = None
    priority: Priority = "interactive"
    created_at: float = msgspec.field(default_factory=time.time)
    revoked_at: float | None = None
    # LoRA adapters (names) only this team may use: another team's request for one is refused
    # as an unknown model (docs/engine.md "LoRA adapters"). Others' adapters are open to all.
    adapters: list[str] = msgspec.field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class TeamsFile(msgspec.Struct, kw_only=True):
    v: int = 1
    fleet_public_key: str = ""
    teams: list[Team] = msgspec.field(default_factory=list)

    def get(self, name: str) -> Team | None:
        return next((t for t in self.teams if t.name == name), None)

    def active(self) -> list[Team]:
        return [t for t in self.teams if t.active]


class TeamError(ValueError):
    pass


def secure_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "secure"


def new_user_seed() -> bytes:
    """A fresh nkey user seed ("SU...")."""
    raw = bytes(nacl.signing.SigningKey.generate())
    return bytes(nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER))


def public_key_of(seed: bytes) -> str:
    return str(nkeys.from_seed(bytearray(seed)).public_key.decode())


def _write_secret(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data + b"\n")


class TeamStore:
    """The teams file and seed files under one directory. Every change rewrites the file
    atomically (write + rename), so a router reading it never sees half a file."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / "teams.json"

    def load(self) -> TeamsFile:
        if not self.path.exists():
            return TeamsFile()
        return msgspec.json.decode(self.path.read_bytes(), type=TeamsFile)

    def save(self, tf: TeamsFile) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(tf)))
        tmp.replace(self.path)

    @property
    def fleet_seed_file(self) -> Path:
        return self.dir / "fleet.nk"

    def seed_file(self, team: str) -> Path:
        return self.dir / "teams" / f"{team}.nk"

    def ensure_fleet(self) -> TeamsFile:
        """The fleet's own user key (made once); returns the teams file naming it."""
        tf = self.load()
        if not self.fleet_seed_file.exists() or not tf.fleet_public_key:
            seed = new_user_seed()
            _write_secret(self.fleet_seed_file, seed)
            tf.fleet_public_key = public_key_of(seed)
            self.save(tf)
        return tf

    def add(
        self,
        name: str,
        rpm: int | None = None,
        tpm: int | None = None,
        weight: float = 1.0,
        max_waiting: int | None = None,
        priority: Priority = "interactive",
    ) -> Team:
        """A new team with a fresh key (its seed written to ``seed_file(name)``). A revoked
        team's name can be added again: it gets a new key; the old one stays refused."""
        if not valid_team(name):
            raise TeamError(
                f"team name {name!r} must match [a-z][a-z0-9_-]{{0,31}} (it becomes a NATS "
                "subject token and account name)"
            )
        tf = self.ensure_fleet()
        old = tf.get(name)
        if old is not None and old.active:
            raise TeamError(f"team {name!r} exists; revoke it first to issue a new key")
        seed = new_user_seed()
        if weight <= 0:
            raise TeamError(f"weight must be > 0, not {weight}")
        team = Team(
            name=name,
            public_key=public_key_of(seed),
            rpm=rpm,
            tpm=tpm,
            weight=weight,
            max_waiting=max_waiting,
            priority=priority,
        )
        tf.teams = [t for t in tf.teams if t.name != name] + [team]
        _write_secret(self.seed_file(name), seed)
        self.save(tf)
        return team

    def revoke(self, name: str) -> Team:
        tf = self.load()
        team = tf.get(name)
        if team is None or not team.active:
            raise TeamError(f"no active team {name!r}")
        team.revoked_at = time.time()
        self.save(tf)
        self.seed_file(name).unlink(missing_ok=True)
        return team
