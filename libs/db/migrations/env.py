"""Alembic environment: run on the connection ``libs.db.Database.migrate`` hands over."""

from __future__ import annotations

from alembic import context

from libs.db.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
