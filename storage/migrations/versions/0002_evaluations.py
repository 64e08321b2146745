"""Add federated-evaluation accounting: the evaluations table.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28

One row per site evaluated (or dropped) at a server step, with the serialized sizes of the
evaluate message and reply. Existing ledgers keep every row; their rounds simply have no
evaluations (the per-round and per-site evaluation traffic is summed when read, so nothing
needs backfilling). Like 0001, a frozen copy of the schema: plain SQL types, names spelled out.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the evaluations table with its keys, constraints and indexes."""
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("num_examples", sa.BigInteger(), nullable=True),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("accuracy", sa.Double(), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("arrived_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('evaluated', 'dropped')", name=op.f("ck_evaluations_status")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_evaluations_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["site_id"],
            ["sites.id"],
            name=op.f("fk_evaluations_site_id_sites"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
        sa.UniqueConstraint(
            "run_id", "round", "site_id", name=op.f("uq_evaluations_run_id_round_site_id")
        ),
    )
    op.create_index(
        op.f("ix_evaluations_run_id_round"), "evaluations", ["run_id", "round"], unique=False
    )
    op.create_index(op.f("ix_evaluations_site_id"), "evaluations", ["site_id"], unique=False)


def downgrade() -> None:
    """Drop the evaluations table (its indexes go with it); 0001's tables are untouched."""
    op.drop_index(op.f("ix_evaluations_site_id"), table_name="evaluations")
    op.drop_index(op.f("ix_evaluations_run_id_round"), table_name="evaluations")
    op.drop_table("evaluations")
