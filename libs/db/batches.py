"""The Files and Batch APIs' rows: files (a batch's input, its output and error files), batches
and one result row per answered line.

Every read is scoped to the API key that owns the row (another key's id reads as absent),
except the batch runner's, which acts for whichever key submitted the batch (``ANY_KEY``).
``record`` is what answers a line once: the result row's key is (batch_id, line), and the
batch's counts move in the same transaction, only when the row is new.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from libs.db import Database
from libs.db.models import BatchResult, BatchRow, StoredFile

# The batch runner's reads: any key's batch.
ANY_KEY = object()
# Statuses after which a batch takes no more lines.
DONE = frozenset({"completed", "failed", "cancelled", "expired"})


def _key_is(column: Any, api_key_id: str | object | None) -> list[ColumnElement[bool]]:
    if api_key_id is ANY_KEY:
        return []
    return [column.is_(None) if api_key_id is None else column == api_key_id]


@dataclass
class Page:
    rows: list[Any]
    has_more: bool


class BatchStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # ------------------------------------------------------------ files

    async def put_file(
        self,
        file_id: str,
        api_key_id: str | None,
        purpose: str,
        filename: str,
        content: bytes,
    ) -> StoredFile:
        row = StoredFile(
            id=file_id,
            api_key_id=api_key_id,
            purpose=purpose,
            filename=filename,
            size=len(content),
            created_at=datetime.now(UTC),
            content=content,
        )
        async with self.db.session() as s, s.begin():
            s.add(row)
        return row

    async def get_file(self, file_id: str, api_key_id: str | object | None) -> StoredFile | None:
        async with self.db.session() as s:
            q = select(StoredFile).where(
                StoredFile.id == file_id, *_key_is(StoredFile.api_key_id, api_key_id)
            )
            return (await s.execute(q)).scalar_one_or_none()

    async def list_files(
        self, api_key_id: str | None, purpose: str | None, limit: int, after: str | None
    ) -> Page:
        """Newest first (OpenAI's default order), ``limit`` after the file ``after``."""
        conds = _key_is(StoredFile.api_key_id, api_key_id)
        if purpose:
            conds.append(StoredFile.purpose == purpose)
        return await self._page(StoredFile, conds, limit, after)

    async def delete_file(self, file_id: str, api_key_id: str | None) -> bool:
        async with self.db.session() as s, s.begin():
            r = await s.execute(
                delete(StoredFile).where(
                    StoredFile.id == file_id, *_key_is(StoredFile.api_key_id, api_key_id)
                )
            )
            return bool(getattr(r, "rowcount", 0))

    # ------------------------------------------------------------ batches

    async def add_batch(self, row: BatchRow) -> None:
        async with self.db.session() as s, s.begin():
            s.add(row)

    async def get_batch(self, batch_id: str, api_key_id: str | object | None) -> BatchRow | None:
        async with self.db.session() as s:
            q = select(BatchRow).where(
                BatchRow.id == batch_id, *_key_is(BatchRow.api_key_id, api_key_id)
            )
            return (await s.execute(q)).scalar_one_or_none()

    async def list_batches(self, api_key_id: str | None, limit: int, after: str | None) -> Page:
        return await self._page(BatchRow, _key_is(BatchRow.api_key_id, api_key_id), limit, after)

    async def batches_in(self, statuses: list[str]) -> list[BatchRow]:
        async with self.db.session() as s:
            q = select(BatchRow).where(BatchRow.status.in_(statuses))
            return list((await s.execute(q)).scalars().all())

    async def set_status(
        self, batch_id: str, status: str, from_statuses: list[str], **fields: Any
    ) -> bool:
        """Move the batch to ``status`` (stamping ``<status>_at``) if it is in one of
        ``from_statuses``; False if it was not (another process moved it first)."""
        async with self.db.session() as s, s.begin():
            row = await s.get(BatchRow, batch_id, with_for_update=True)
            if row is None or row.status not in from_statuses:
                return False
            row.status = status
            row.body = {**row.body, f"{status}_at": int(time.time()), **fields}
            return True

    async def line_state(self, batch_id: str, line: int) -> tuple[BatchRow | None, bool]:
        """A line's batch (any key's) and whether the line has its answer, in one session (the
        runner asks both for every line it takes)."""
        async with self.db.session() as s:
            row = await s.get(BatchRow, batch_id)
            answered = row is not None and await s.get(BatchResult, (batch_id, line)) is not None
            return row, answered

    async def record(
        self, batch_id: str, line: int, ok: bool, result: dict[str, Any]
    ) -> tuple[bool, bool]:
        """The answer to ``line``, once: (whether this call stored it, False for a redelivery;
        whether every line of the batch has its answer now, from the same UPDATE)."""
        try:
            async with self.db.session() as s, s.begin():
                if await s.get(BatchResult, (batch_id, line)) is not None:
                    return False, False
                s.add(BatchResult(batch_id=batch_id, line=line, ok=ok, result=result))
                await s.flush()
                counter = BatchRow.completed if ok else BatchRow.failed
                r = await s.execute(
                    update(BatchRow)
                    .where(BatchRow.id == batch_id)
                    .values({counter: counter + 1})
                    .returning(BatchRow.completed + BatchRow.failed >= BatchRow.total)
                )
                all_answered = bool(r.scalar_one_or_none())
        except IntegrityError:  # another runner committed the same line first
            return False, False
        return True, all_answered

    async def finalize(
        self, batch_id: str, status: str, from_statuses: list[str]
    ) -> BatchRow | None:
        """Write the output and error files from the result rows (lines in input order) and
        move the batch to ``status``, in one transaction; None if it was not in
        ``from_statuses`` (already finalized)."""
        async with self.db.session() as s, s.begin():
            row = await s.get(BatchRow, batch_id, with_for_update=True)
            if row is None or row.status not in from_statuses:
                return None
            q = (
                select(BatchResult)
                .where(BatchResult.batch_id == batch_id)
                .order_by(BatchResult.line)
            )
            results = (await s.execute(q)).scalars().all()
            now = datetime.now(UTC)
            for ok, suffix in ((True, "output"), (False, "errors")):
                lines = [msgspec.json.encode(r.result) + b"\n" for r in results if r.ok == ok]
                if not lines:
                    continue
                content = b"".join(lines)
                file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
                s.add(
                    StoredFile(
                        id=file_id,
                        api_key_id=row.api_key_id,
                        purpose="batch_output",
                        filename=f"{batch_id}_{suffix}.jsonl",
                        size=len(content),
                        created_at=now,
                        content=content,
                    )
                )
                if ok:
                    row.output_file_id = file_id
                else:
                    row.error_file_id = file_id
            row.status = status
            row.body = {**row.body, f"{status}_at": int(time.time())}
            return row

    async def result_count(self, batch_id: str) -> int:
        async with self.db.session() as s:
            q = select(func.count()).where(BatchResult.batch_id == batch_id)
            return int((await s.execute(q)).scalar_one())

    async def _page(
        self,
        table: type[StoredFile] | type[BatchRow],
        conds: list[Any],
        limit: int,
        after: str | None,
    ) -> Page:
        async with self.db.session() as s:
            if after:
                anchor: Any = await s.get(table, after)
                if anchor is not None:
                    conds = [
                        *conds,
                        (table.created_at < anchor.created_at)
                        | ((table.created_at == anchor.created_at) & (table.id < anchor.id)),
                    ]
            q = (
                select(table)
                .where(*conds)
                .order_by(table.created_at.desc(), table.id.desc())
                .limit(limit + 1)
            )
            rows = list((await s.execute(q)).scalars().all())
        return Page(rows[:limit], len(rows) > limit)
