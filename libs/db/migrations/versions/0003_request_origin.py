"""requests: a request is (origin, request_id) — a team account's ids are its own

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26

``origin`` is the team account a request came in through (``GenerateRequest.origin``), ''
for the fleet's own (the gateway, internal clients). Existing rows that only a team account
can have written (a worker's row, no API key, a team) take that team as their origin; the
rest are the fleet's.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as b:
        b.add_column(sa.Column("origin", sa.String(32), nullable=False, server_default=""))
    op.execute(
        "UPDATE requests SET origin = team "
        "WHERE source = 'worker' AND api_key_id IS NULL AND team IS NOT NULL"
    )
    _primary_key(["request_id", "origin"])


def downgrade() -> None:
    # Two teams' rows of one id cannot both stay under a key of the id alone: keep the
    # fleet's row, else the first team's.
    op.execute(
        "DELETE FROM requests WHERE origin <> '' AND EXISTS (SELECT 1 FROM requests r "
        "WHERE r.request_id = requests.request_id AND (r.origin = '' OR r.origin < "
        "requests.origin))"
    )
    _primary_key(["request_id"])
    with op.batch_alter_table("requests") as b:
        b.drop_column("origin")


def _primary_key(columns: list[str]) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint("requests_pkey", "requests", type_="primary")
        op.create_primary_key("requests_pkey", "requests", columns)
        return
    # SQLite cannot alter a primary key: batch mode copies the rows into a table of this shape.
    with op.batch_alter_table("requests", copy_from=_requests(columns), recreate="always"):
        pass


def _requests(primary_key: list[str]) -> sa.Table:
    """The ``requests`` table as of this revision, keyed by ``primary_key``."""

    def col(name: str, type_: Any, **kw: Any) -> sa.Column[Any]:
        return sa.Column(name, type_, primary_key=name in primary_key, **kw)

    return sa.Table(
        "requests",
        sa.MetaData(),
        col("request_id", sa.String(128), nullable=False),
        col("api_key_id", sa.String(64), nullable=True),
        col("pool", sa.String(128), nullable=False),
        col("model", sa.Text(), nullable=False),
        col("worker_id", sa.String(200), nullable=False),
        col("route_code", sa.String(64), nullable=False),
        col("route_factors", sa.JSON(), nullable=False),
        col("prompt_tokens", sa.Integer(), nullable=False),
        col("completion_tokens", sa.Integer(), nullable=False),
        col("cached_tokens", sa.Integer(), nullable=False),
        col("queued_s", sa.Float(), nullable=False),
        col("ttft_s", sa.Float(), nullable=True),
        col("total_s", sa.Float(), nullable=False),
        col("status", sa.String(16), nullable=False),
        col("error_code", sa.String(64), nullable=True),
        col("error", sa.Text(), nullable=True),
        col("source", sa.String(32), nullable=False),
        col("created_at", sa.DateTime(timezone=True), nullable=False),
        col("finished_at", sa.DateTime(timezone=True), nullable=False),
        col("team", sa.String(32), nullable=True),
        col("origin", sa.String(32), nullable=False, server_default=""),
        sa.Index("ix_requests_api_key_id_created_at", "api_key_id", "created_at"),
        sa.Index("ix_requests_created_at", "created_at"),
        sa.Index("ix_requests_team_created_at", "team", "created_at"),
    )
