"""responses: the owner and lease of a running background response

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27

A background response is run by one gateway process, which renews ``lease_until`` while it
runs; any gateway stores a still-running response whose lease ran out as ``failed`` (its owner
was killed before it could say so).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as t:
        t.add_column(sa.Column("owner", sa.String(64), nullable=True))
        t.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_responses_lease_until", "responses", ["lease_until"])


def downgrade() -> None:
    op.drop_index("ix_responses_lease_until", table_name="responses")
    with op.batch_alter_table("responses") as t:
        t.drop_column("lease_until")
        t.drop_column("owner")
