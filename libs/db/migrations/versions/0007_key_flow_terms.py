"""api_keys: a key's flow-control terms (docs/flow-control.md): weight, waiting bound, best band

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as b:
        b.add_column(sa.Column("weight", sa.Float, nullable=True))
        b.add_column(sa.Column("max_waiting", sa.Integer, nullable=True))
        b.add_column(sa.Column("priority", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as b:
        b.drop_column("priority")
        b.drop_column("max_waiting")
        b.drop_column("weight")
