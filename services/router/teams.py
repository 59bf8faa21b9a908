"""Per-team admission in the router (docs/security.md): who a request is from, whether that
team is still allowed, and its rate limits.

``Router.handle`` calls ``attribute`` on every request pulled from the requests stream: a
request that arrived on ``<p>.requests.<team>`` (a team's account, through its import) is
stamped with that team and its tokens go to ``<p>.stream.<team>.<id>``, whatever the sender
wrote in ``team``, ``api_key_id`` or ``reply_subject``. Then ``admit`` refuses revoked teams and
applies the team's requests/tokens per minute (``libs.flow.ratelimit``, the gateway's semantics) to
every request with a team: from NATS, and from the gateway for keys of a team. The router's
stream watch calls ``finished`` when a request's stream ends: its reservation becomes its
usage.

The teams file (``Settings.teams_file``, written by ``strait teams``) is re-read when its
modification time changes, checked at most every ``teams.reload_interval_s`` and at once on a
``TeamsChanged`` message.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.flow.ratelimit import RateLimiter, Refusal, reserve_estimate
from libs.flow.tenant import capped
from libs.log import fields
from libs.protocol import ErrorCode, Finished, GenerateRequest, Subjects
from libs.security.teams import Team, TeamsFile
from libs.settings import Settings

log = logging.getLogger("strait.router")

# Reservations awaiting their request's end (a request the watch never sees end is dropped
# oldest first past this).
MAX_RESERVATIONS = 100_000


@dataclass(frozen=True)
class TeamRefusal:
    code: ErrorCode  # permission_denied (revoked) | rate_limited
    message: str
    retry_after_s: float | None


class TeamPolicy:
    def __init__(self, settings: Settings) -> None:
        self.subjects = Subjects.of(settings.nats)
        self.cfg = settings.teams
        self.path: Path = settings.teams_file
        self.limiter = RateLimiter()
        # request key → (team, tokens reserved by admit), until finished (oldest dropped first).
        self.reserved: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.limits: dict[str, tuple[int | None, int | None]] = {}
        self.terms: dict[str, Team] = {}  # active teams' entries (flow control's terms)
        self.revoked: set[str] = set()
        self.adapter_owner: dict[str, str] = {}  # LoRA adapter → the one team that may use it
        self._mtime: float | None = None
        self._checked = float("-inf")

    def reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.cfg.reload_interval_s:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime and not force:
            return
        self._mtime = mtime
        tf = TeamsFile()
        if mtime is not None:
            try:
                tf = msgspec.json.decode(self.path.read_bytes(), type=TeamsFile)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("teams file unreadable; keeping the last", extra=fields(error=str(e)))
                return
        self.limits = {t.name: (t.rpm, t.tpm) for t in tf.active()}
        self.terms = {t.name: t for t in tf.active()}
        self.adapter_owner = {a: t.name for t in tf.teams for a in t.adapters}
        self.revoked = {t.name for t in tf.teams if not t.active}
        log.info("teams loaded", extra=fields(active=len(self.limits), revoked=len(self.revoked)))

    def may_use(self, adapter: str, team: str | None) -> bool:
        """Whether a request of ``team`` (None: the fleet's own, no team) may use ``adapter``:
        any adapter no team owns; an owned one only by its team."""
        self.reload()
        owner = self.adapter_owner.get(adapter)
        return owner is None or owner == team

    def revoke(self, teams: list[str]) -> None:
        self.reload(force=True)
        self.revoked |= set(teams)
        for t in teams:
            self.limits.pop(t, None)

    def sender(self, subject: str) -> str | None:
        """The team whose account a request arrived from (its subject); None: the fleet's."""
        try:
            return self.subjects.team_of(subject, "requests")
        except ValueError:
            return None

    def attribute(self, req: GenerateRequest, subject: str) -> GenerateRequest:
        """``req`` as the fleet will run it: a team's request carries the team the server
        delivered it as, its stream goes to that team's export, and no API key id."""
        team = self.sender(subject)
        if team is None:
            # The fleet's own subject: the gateway or a trusted internal client; its ids are
            # the fleet's (no origin, whatever the payload says).
            return req if req.origin is None else msgspec.structs.replace(req, origin=None)
        return msgspec.structs.replace(
            req,
            team=team,
            origin=team,
            api_key_id=None,
            reply_subject=self.subjects.team_stream(team, req.request_id),
        )

    def with_terms(self, req: GenerateRequest) -> GenerateRequest:
        """``req`` under its team's flow-control terms (weight, waiting bound, best band) when
        the teams file has an entry for it; a team's own request never keeps the weight or
        bound it wrote itself."""
        if req.team is None:
            return req
        self.reload()
        entry = self.terms.get(req.team)
        if entry is None:
            if req.origin is None:
                return req  # the gateway's or an internal client's terms stand
            return msgspec.structs.replace(req, tenant_weight=None, tenant_max_waiting=None)
        return msgspec.structs.replace(
            req,
            tenant_weight=entry.weight,
            tenant_max_waiting=entry.max_waiting,
            priority=capped(req.priority, entry.priority),
        )

    def admit(self, req: GenerateRequest) -> int | TeamRefusal:
        """Tokens reserved for ``req`` (0 without a team), or why it is refused."""
        if req.team is None:
            return 0
        self.reload()
        if req.team in self.revoked:
            return TeamRefusal("permission_denied", f"team {req.team!r} is revoked", None)
        rpm, tpm = self.limits.get(req.team, (None, None))
        got = self.limiter.admit(
            req.team,
            rpm or self.cfg.default_rpm,
            tpm or self.cfg.default_tpm,
            reserve_estimate(req),
        )
        if isinstance(got, Refusal):
            msg = f"rate limit reached for team {req.team!r}: {got.message}"
            return TeamRefusal("rate_limited", msg, got.retry_after_s)
        self.reserved[req.key] = (req.team, got)
        while len(self.reserved) > MAX_RESERVATIONS:
            self.reserved.popitem(last=False)
        return got

    def finished(self, req: GenerateRequest, final: Finished | None) -> None:
        """``req``'s stream ended: its reservation becomes its usage (kept whole when it ended
        without ``Finished``)."""
        held = self.reserved.pop(req.key, None)
        if held is not None and final is not None:
            used = final.usage.prompt_tokens + final.usage.completion_tokens
            self.limiter.settle(held[0], held[1], used)
