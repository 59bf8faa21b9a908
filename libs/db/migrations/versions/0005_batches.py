"""batches: the Files and Batch APIs' files, batches and one result row per answered line

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27

``POST /v1/files`` keeps a batch's JSONL input; ``POST /v1/batches`` its state; the batch
runner one ``batch_results`` row per line, keyed by (batch_id, line), so a redelivered line is
answered once; the output and error files are ``files`` rows too.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_files_api_key_id_created_at", "files", ["api_key_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("team", sa.String(32), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_batches_api_key_id_created_at", "batches", ["api_key_id", "created_at"])
    op.create_table(
        "batch_results",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("line", sa.Integer(), primary_key=True),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("batch_results")
    op.drop_index("ix_batches_api_key_id_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_api_key_id_created_at", table_name="files")
    op.drop_table("files")
