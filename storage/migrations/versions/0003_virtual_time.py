"""Add simulated (virtual) time: the network a run simulated and virtual-clock columns.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05

Simulated runs advance a virtual clock (float seconds since the simulated start of the run,
0.0 at the start) that is unrelated to the wall clock the ledger already records, so the
staleness and waiting a site would see over a real network can be read back. Every new column
is nullable: wall-clock runs, and every row written before this revision, simply have NULL
there, so nothing needs backfilling.

- ``runs``: ``network`` (the preset name or TOML path the run simulated) and
  ``simulated_seconds`` (simulated elapsed time of the whole run).
- ``rounds``: ``virtual_started_at``, ``virtual_finished_at``.
- ``updates``: ``virtual_dispatched_at``, ``virtual_arrived_at``, ``virtual_compute_seconds``
  and ``transfer_seconds`` (simulated download plus upload time).

Like 0001 and 0002, a frozen copy of the schema: plain SQL types, names spelled out. The
downgrade drops the columns with plain ``ALTER TABLE ... DROP COLUMN`` rather than batch mode:
on SQLite batch mode would recreate ``runs`` by dropping it, and with foreign keys enforced
that drop cascades to every site, round and update. SQLite has had ``DROP COLUMN`` since 3.35.
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, type) in the order they are added; the downgrade drops them in reverse.
_COLUMNS: tuple[tuple[str, str, sa.types.TypeEngine[Any]], ...] = (
    ("runs", "network", sa.String(length=255)),
    ("runs", "simulated_seconds", sa.Double()),
    ("rounds", "virtual_started_at", sa.Double()),
    ("rounds", "virtual_finished_at", sa.Double()),
    ("updates", "virtual_dispatched_at", sa.Double()),
    ("updates", "virtual_arrived_at", sa.Double()),
    ("updates", "virtual_compute_seconds", sa.Double()),
    ("updates", "transfer_seconds", sa.Double()),
)


def upgrade() -> None:
    """Add the nullable virtual-time columns; existing rows get NULL."""
    for table, name, type_ in _COLUMNS:
        op.add_column(table, sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    """Drop the virtual-time columns; every other column and row is kept."""
    for table, name, _ in reversed(_COLUMNS):
        op.drop_column(table, name)
