"""Add wire traffic: the ``traffic`` table.

Revision ID: 0006
Revises: 0005
Create Date: 2027-03-01

The ledger's bytes are what Flower's SuperLink counts on its Fleet API (every message's
protocol envelope included), so a run's totals agree with ``flwr ls``. Update and evaluation
rows count their own messages and replies; ``traffic`` holds the rest, one row per batch of
messages with one site: its kind (``query``: the site-information queries a site is sent
when it joins; ``train``, ``evaluate``: a reply that came after the server stopped waiting
for it), how many messages it is for, the bytes each way, and the server step during which
they crossed (NULL before a process's first step: sites joining, or rejoining on resume).

Rows written before this revision keep everything: their runs simply have no traffic rows,
and their bytes stay the payload sizes the ledger measured then. Like 0002, a frozen copy
of the schema: plain SQL types, names spelled out.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the traffic table with its keys, constraint and indexes."""
    op.create_table(
        "traffic",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("messages", sa.Integer(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("kind IN ('train', 'evaluate', 'query')", name=op.f("ck_traffic_kind")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_traffic_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["site_id"], ["sites.id"], name=op.f("fk_traffic_site_id_sites"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traffic")),
    )
    op.create_index(op.f("ix_traffic_run_id"), "traffic", ["run_id"], unique=False)
    op.create_index(op.f("ix_traffic_site_id"), "traffic", ["site_id"], unique=False)


def downgrade() -> None:
    """Drop the traffic table (its indexes go with it); every other row is kept."""
    op.drop_index(op.f("ix_traffic_site_id"), table_name="traffic")
    op.drop_index(op.f("ix_traffic_run_id"), table_name="traffic")
    op.drop_table("traffic")
