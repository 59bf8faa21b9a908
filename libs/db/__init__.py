"""Strait's database: API keys and the request ledger (SQLAlchemy 2 async, Alembic).

``Database(settings)`` owns one async engine; ``migrate()`` brings the schema to the newest
Alembic revision (called at start-up by the gateway, ``strait keys`` and ``ensure_dev_key``).
SQLite through aiosqlite is the embedded default (``Settings.database_url``); PostgreSQL through
asyncpg in compose and tests (``database.pg_schema`` puts the tables in one schema).

    keys.py    create / list / revoke / verify API keys (secrets stored as salted scrypt hashes)
    ledger.py  JetStream usage events -> ``requests`` rows, upserted by request id
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from libs.settings import Settings

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: serialises concurrent migrations of several replicas on PostgreSQL.
_MIGRATION_LOCK_ID = 0x53545241  # "STRA"


def make_engine(url: str, pg_schema: str = "", echo: bool = False) -> AsyncEngine:
    kwargs: dict[str, Any] = {"echo": echo, "pool_pre_ping": True}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30}
    elif pg_schema:
        kwargs["connect_args"] = {"server_settings": {"search_path": pg_schema}}
    engine = create_async_engine(url, **kwargs)
    if url.startswith("sqlite"):

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

    return engine


class Database:
    def __init__(self, settings: Settings, url: str | None = None) -> None:
        self.url = url or settings.database_url
        self.sqlite_file: Path | None = None
        if self.url.startswith("sqlite"):
            # The embedded default lives in the state dir, which may not exist yet.
            path = self.url.split(":///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self.sqlite_file = Path(path)
        self.engine = make_engine(self.url, settings.database.pg_schema, settings.database.echo)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def session(self) -> AsyncSession:
        return self.sessions()

    async def migrate(self) -> None:
        """Upgrade to the newest revision; safe to call from every replica at once: an advisory
        lock on PostgreSQL, a lock file beside the SQLite file (SQLite's DDL is not in the
        transaction, so two processes migrating a new file at once would both create tables:
        the gateway and `strait batch` starting together)."""
        if self.sqlite_file is not None:
            lock = await asyncio.to_thread(
                _file_lock, self.sqlite_file.with_name(self.sqlite_file.name + ".migrate-lock")
            )
            with lock:
                await self._migrate()
            return
        await self._migrate()

    async def _migrate(self) -> None:
        async with self.engine.begin() as conn:
            if self.dialect == "postgresql":
                await conn.execute(text(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_ID})"))
            await conn.run_sync(_upgrade)

    async def close(self) -> None:
        await self.engine.dispose()


def _file_lock(path: Path) -> contextlib.AbstractContextManager[None]:
    """An exclusive lock on ``path`` (created), taken now (blocking); released on exit."""
    f = open(path, "a")
    fcntl.flock(f, fcntl.LOCK_EX)

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    return held()


def _upgrade(conn: Connection) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "head")
