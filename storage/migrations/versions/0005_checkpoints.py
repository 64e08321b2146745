"""Add resume: the ``checkpoints`` and ``run_events`` tables and ``runs.owner``.

Revision ID: 0005
Revises: 0004
Create Date: 2027-02-01

A run is resumable from its last committed round, so each round is committed with the file
that holds the run's whole state at its end:

- ``checkpoints``: one row per checkpoint file still on disk (run, round, the model version
  it holds, the file's path and size, whether retention keeps it, when it was written). A
  round and its checkpoint row are written in one transaction; the row goes when its file
  does (retention), so a row names a file that should exist.
- ``run_events``: what happened to a run besides its rounds (``resumed``, ...), with when
  and a JSON detail.
- ``runs.owner``: ``host:pid`` of the process recording the run, so a resume can refuse a
  run whose process is still alive.

Rows written before this revision keep everything: old runs have no owner, no events and no
checkpoints (they cannot be resumed, and they are still listed and read as before). Like
0003, the downgrade drops ``owner`` with plain ``ALTER TABLE ... DROP COLUMN``, not batch
mode, which would recreate ``runs`` and so cascade to every row referring to it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the checkpoint and event tables; add the nullable ``runs.owner``."""
    op.add_column("runs", sa.Column("owner", sa.String(length=255), nullable=True))
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("kept", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "round", name=op.f("uq_checkpoints_run_id_round")),
    )
    op.create_table(
        "run_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_events")),
    )
    op.create_index(op.f("ix_run_events_run_id"), "run_events", ["run_id"], unique=False)


def downgrade() -> None:
    """Drop the checkpoint and event tables and ``runs.owner``; every other row is kept."""
    op.drop_index(op.f("ix_run_events_run_id"), table_name="run_events")
    op.drop_table("run_events")
    op.drop_table("checkpoints")
    op.drop_column("runs", "owner")
