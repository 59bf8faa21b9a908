"""Stored responses (``POST /v1/responses`` with ``store``): put, get and delete by id, each
scoped to the API key that created the response (another key's id reads as absent). A
background response (``services.gateway.background``) is put when it is queued and moved on by
``advance``, which only writes while the stored status is still one the writer expects, so a
cancel and the run's own end cannot overwrite each other. While it runs it carries the
``owner`` gateway process and a ``lease_until`` that owner renews (``renew``); ``expired``
and ``reap`` find and end the ones whose owner stopped renewing (killed)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.sql.elements import ColumnElement

from libs.db import Database
from libs.db.models import StoredResponse


def _owned(response_id: str, api_key_id: str | None) -> list[ColumnElement[bool]]:
    key = (
        StoredResponse.api_key_id.is_(None)
        if api_key_id is None
        else StoredResponse.api_key_id == api_key_id
    )
    return [StoredResponse.id == response_id, key]


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def put(
        self,
        response_id: str,
        api_key_id: str | None,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        owner: str | None = None,
        lease_until: datetime | None = None,
    ) -> None:
        """Insert or replace (a background response is put when it starts, with its ``owner``
        and ``lease_until``, and when it ends)."""
        async with self.db.session() as s, s.begin():
            row = await s.get(StoredResponse, response_id)
            if row is None:
                s.add(
                    StoredResponse(
                        id=response_id,
                        api_key_id=api_key_id,
                        created_at=datetime.now(UTC),
                        body=body,
                        history=history,
                        owner=owner,
                        lease_until=lease_until,
                    )
                )
            elif row.api_key_id == api_key_id:
                row.body, row.history = body, history

    async def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        async with self.db.session() as s:
            q = select(StoredResponse).where(*_owned(response_id, api_key_id))
            return (await s.execute(q)).scalar_one_or_none()

    async def delete(self, response_id: str, api_key_id: str | None) -> bool:
        async with self.db.session() as s, s.begin():
            r = await s.execute(delete(StoredResponse).where(*_owned(response_id, api_key_id)))
            return bool(getattr(r, "rowcount", 0))

    async def advance(
        self,
        response_id: str,
        api_key_id: str | None,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        from_statuses: tuple[str, ...],
    ) -> bool:
        """Replace the response's body and conversation if its stored ``status`` is one of
        ``from_statuses``; False if it is not (cancelled, ended or deleted meanwhile). One
        conditional UPDATE, so the check and the write are atomic on SQLite and PostgreSQL."""
        status = StoredResponse.body["status"].as_string()
        async with self.db.session() as s, s.begin():
            r = await s.execute(
                update(StoredResponse)
                .where(*_owned(response_id, api_key_id), status.in_(from_statuses))
                .values(body=body, history=history)
            )
            return bool(getattr(r, "rowcount", 0))

    async def renew(self, owner: str, lease_until: datetime, active: tuple[str, ...]) -> int:
        """Extend the lease of every response ``owner`` still runs (status in ``active``): one
        UPDATE for all of them; returns how many."""
        status = StoredResponse.body["status"].as_string()
        async with self.db.session() as s, s.begin():
            r = await s.execute(
                update(StoredResponse)
                .where(StoredResponse.owner == owner, status.in_(active))
                .values(lease_until=lease_until)
            )
            return int(getattr(r, "rowcount", 0))

    async def expired(
        self, now: datetime, active: tuple[str, ...], limit: int
    ) -> list[StoredResponse]:
        """Up to ``limit`` responses still in ``active`` whose lease ended before ``now``."""
        status = StoredResponse.body["status"].as_string()
        async with self.db.session() as s:
            q = (
                select(StoredResponse)
                .where(StoredResponse.lease_until < now, status.in_(active))
                .order_by(StoredResponse.lease_until)
                .limit(limit)
            )
            return list((await s.execute(q)).scalars())

    async def reap(
        self, row: StoredResponse, body: dict[str, Any], now: datetime, active: tuple[str, ...]
    ) -> bool:
        """Store ``body`` (the response ``failed``) for ``row`` if it is still in ``active``
        and its lease still ended before ``now``: an owner that renewed meanwhile, or a run
        that ended, wins. One conditional UPDATE."""
        status = StoredResponse.body["status"].as_string()
        async with self.db.session() as s, s.begin():
            r = await s.execute(
                update(StoredResponse)
                .where(
                    StoredResponse.id == row.id,
                    StoredResponse.lease_until < now,
                    status.in_(active),
                )
                .values(body=body, lease_until=None)
            )
            return bool(getattr(r, "rowcount", 0))
