"""Add the delayed-compensated-update columns to ``updates``: period, average applied, delay.

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-10

A delayed strategy lets a fast site start the work of period r+1 before the average of period
r has formed, so an update is sent *for* a period that may differ from the round it was
dispatched in, from a model that holds an older global average.

- ``period``: the round whose average the update was sent for.
- ``average_applied``: index of the latest global average the site had swapped into its model
  before computing the update (the model version it was sent).
- ``delay``: ``period - 1 - average_applied``, how many rounds old that average was
  (0 is local SGD).

Every column is nullable: other strategies, and every row written before this revision, have
NULL there, so nothing needs backfilling. Like 0003, the downgrade drops the columns with plain
``ALTER TABLE ... DROP COLUMN`` rather than SQLite's batch mode, which would recreate (so drop)
the table and, with foreign keys enforced, could cascade to rows that refer to it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Columns of ``updates`` in the order they are added; the downgrade drops them in reverse.
_COLUMNS: tuple[str, ...] = ("period", "average_applied", "delay")


def upgrade() -> None:
    """Add the nullable delayed-update columns; existing rows get NULL."""
    for name in _COLUMNS:
        op.add_column("updates", sa.Column(name, sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop the delayed-update columns; every other column and row is kept."""
    for name in reversed(_COLUMNS):
        op.drop_column("updates", name)
