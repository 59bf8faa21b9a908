"""responses: stored Responses API objects, per API key

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26

``POST /v1/responses`` with ``store`` keeps the response and the conversation it ends, for
``GET /v1/responses/{id}`` and a follow-up's ``previous_response_id``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
    )
    op.create_index("ix_responses_api_key_id_created_at", "responses", ["api_key_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_api_key_id_created_at", table_name="responses")
    op.drop_table("responses")
