"""Add the streaming-sync column to ``updates``: the model fragment an update carried.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

Streaming sync splits the model's arrays into p fragments and syncs one of them each round,
so an update carries one fragment of the model, not the whole of it; the ledger must say
which, or two updates of the same round cannot be told apart by what they changed.

- ``fragment``: the index of the model fragment the update carried (0-based).

The column is nullable: strategies that send the whole model, and every row written before
this revision, have NULL there, so nothing needs backfilling. Like 0004, the downgrade drops
the column with plain ``ALTER TABLE ... DROP COLUMN`` rather than SQLite's batch mode, which
would recreate (so drop) the table and, with foreign keys enforced, could cascade to rows that
refer to it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable fragment column; existing rows get NULL."""
    op.add_column("updates", sa.Column("fragment", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop the fragment column; every other column and row is kept."""
    op.drop_column("updates", "fragment")
