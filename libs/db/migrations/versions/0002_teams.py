"""teams: the team an API key bills as, and the team of each ledger row

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as b:
        b.add_column(sa.Column("team", sa.String(32), nullable=True))
    with op.batch_alter_table("requests") as b:
        b.add_column(sa.Column("team", sa.String(32), nullable=True))
    op.create_index("ix_requests_team_created_at", "requests", ["team", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_requests_team_created_at", table_name="requests")
    with op.batch_alter_table("requests") as b:
        b.drop_column("team")
    with op.batch_alter_table("api_keys") as b:
        b.drop_column("team")
