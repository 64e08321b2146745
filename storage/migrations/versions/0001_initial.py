"""Create the ledger: runs, sites, rounds and site updates.

Revision ID: 0001
Revises:
Create Date: 2026-11-21

A migration is a frozen copy of the schema at its time, so it spells out plain SQL types and
constraint names instead of importing ``storage.models`` (whose Python-side types, such as the
unsigned node id and the UTC datetime, store as ``BIGINT`` and ``TIMESTAMP WITH TIME ZONE``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the four ledger tables with their keys, constraints and indexes."""
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tag", sa.String(length=255), nullable=True),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("strategy", sa.String(length=100), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("num_rounds_planned", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("wall_seconds", sa.Double(), nullable=True),
        sa.Column("final_metrics", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'failed')", name=op.f("ck_runs_status")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("tag", name=op.f("uq_runs_tag")),
    )
    op.create_index(op.f("ix_runs_created_at"), "runs", ["created_at"], unique=False)

    op.create_table(
        "sites",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("node_id", sa.BigInteger(), nullable=False),
        sa.Column("partition_id", sa.Integer(), nullable=True),
        sa.Column("num_examples", sa.BigInteger(), nullable=True),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_sites_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sites")),
        sa.UniqueConstraint("run_id", "name", name=op.f("uq_sites_run_id_name")),
    )

    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("wall_seconds", sa.Double(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("train_loss", sa.Double(), nullable=True),
        sa.Column("num_applied", sa.Integer(), nullable=False),
        sa.Column("num_dropped", sa.Integer(), nullable=False),
        sa.Column("num_rejected", sa.Integer(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rounds_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rounds")),
        sa.UniqueConstraint("run_id", "round", name=op.f("uq_rounds_run_id_round")),
    )

    op.create_table(
        "updates",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("site_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("dispatched_round", sa.Integer(), nullable=False),
        sa.Column("version_trained_on", sa.Integer(), nullable=False),
        sa.Column("staleness", sa.Integer(), nullable=False),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("compute_seconds", sa.Double(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("num_examples", sa.BigInteger(), nullable=True),
        sa.Column("train_loss", sa.Double(), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("arrived_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('applied', 'buffered', 'cancelled', 'dropped', 'rejected')",
            name=op.f("ck_updates_status"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_updates_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["site_id"], ["sites.id"], name=op.f("fk_updates_site_id_sites"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_updates")),
    )
    op.create_index(op.f("ix_updates_run_id_round"), "updates", ["run_id", "round"], unique=False)
    op.create_index(op.f("ix_updates_site_id"), "updates", ["site_id"], unique=False)


def downgrade() -> None:
    """Drop the ledger tables, children first."""
    op.drop_table("updates")
    op.drop_table("rounds")
    op.drop_table("sites")
    op.drop_table("runs")
