"""api_keys and the requests ledger

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret_hash", sa.String(255), nullable=False),
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("route_code", sa.String(64), nullable=False),
        sa.Column("route_factors", sa.JSON, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("queued_s", sa.Float, nullable=False),
        sa.Column("ttft_s", sa.Float, nullable=True),
        sa.Column("total_s", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_requests_api_key_id_created_at", "requests", ["api_key_id", "created_at"])
    op.create_index("ix_requests_created_at", "requests", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_requests_created_at", table_name="requests")
    op.drop_index("ix_requests_api_key_id_created_at", table_name="requests")
    op.drop_table("requests")
    op.drop_table("api_keys")
