"""SQLAlchemy 2.0 models of the ledger: runs, the sites in them, rounds, site updates,
federated evaluations, (migration 0005) the checkpoints and events of runs, and (0006) the
traffic with sites that no update or evaluation row holds.

Times come on two clocks. ``*_at`` datetimes are the wall clock (UTC). ``virtual_*`` floats
are the simulated clock of a run that simulated a network: seconds since the simulated start
of the run (0.0 at the start), NULL for wall-clock runs and for rows older than migration 0003.

The schema is created and changed only by the Alembic migrations in ``storage/migrations``;
``metadata`` here is what those migrations are checked against (a test compares them), never
something to ``create_all`` from.

Every constraint and index is named through ``NAMING_CONVENTION`` so later migrations can
drop or alter them by name on every backend (SQLite's batch mode needs the names).

The ``updates``, ``evaluations`` and ``traffic`` tables are made from the rows declared in
``flplatform.core.ledger_rows``: each column's SQL type follows from its ``Kind`` and its
nullability from its default, and a status column gets its check constraint.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.schema import SchemaItem
from sqlalchemy.types import TypeDecorator, TypeEngine

from flplatform.core.ledger_rows import (
    RUN_STATUSES,
    EvaluationColumns,
    Kind,
    TrafficColumns,
    UpdateColumns,
    columns,
    nullable,
)

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

NAME_LENGTH = 255
STRATEGY_LENGTH = 100
STATUS_LENGTH = 16
EVENT_KIND_LENGTH = 32

_UINT64_RANGE = 2**64
_INT64_MAX = 2**63 - 1


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC ``datetime`` on every backend.

    SQLite has no timezone type and hands back naive datetimes, and PostgreSQL hands back
    the session's timezone; both are normalised to UTC on the way out, and naive values are
    refused on the way in so a local time can never be stored as if it were UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("the ledger stores timezone-aware datetimes only")
        utc = value.astimezone(UTC)
        # SQLite would store "+00:00" only sometimes; keep its text column uniformly naive UTC.
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class UInt64(TypeDecorator[int]):
    """An unsigned 64-bit integer (a Flower node id) kept in a signed ``BIGINT``.

    No portable SQL type holds ``2**64 - 1``; values at or above ``2**63`` are stored as their
    two's-complement negative and converted back on read, so every value round-trips exactly
    and equality filters still work. Ordering in SQL is not meaningful for the high half.
    """

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: int | None, dialect: Dialect) -> int | None:
        if value is None:
            return None
        if not 0 <= value < _UINT64_RANGE:
            raise ValueError(f"{value} is outside the unsigned 64-bit range")
        return value - _UINT64_RANGE if value > _INT64_MAX else value

    def process_result_value(self, value: int | None, dialect: Dialect) -> int | None:
        if value is None:
            return None
        return value + _UINT64_RANGE if value < 0 else value


def _in_clause(column: str, allowed: tuple[str, ...]) -> str:
    """SQL text ``column IN ('a', 'b')`` for a check constraint over fixed string values."""
    return f"{column} IN ({', '.join(repr(value) for value in allowed)})"


class Base(DeclarativeBase):
    """Declarative base carrying the ledger's named-constraint ``metadata``."""

    metadata = metadata
    type_annotation_map = {dict[str, Any]: JSON}


class Run(Base):
    """A federated run; ``tag`` lets a separate process (the CLI) find the run it started."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("tag"),
        CheckConstraint(_in_clause("status", RUN_STATUSES), name="status"),
        Index(None, "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tag: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    strategy: Mapped[str] = mapped_column(String(STRATEGY_LENGTH))
    seed: Mapped[int] = mapped_column(BigInteger)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    num_rounds_planned: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    # Why the run failed; and a warning noted while it ran (training diverged), kept when it
    # finishes (repository.record_round and finish_run).
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    wall_seconds: Mapped[float | None] = mapped_column(Double)
    # none_as_null: a run without final metrics is SQL NULL, not the JSON text 'null'.
    final_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Migration 0003: the network preset or TOML path simulated, and the run's simulated length.
    network: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    simulated_seconds: Mapped[float | None] = mapped_column(Double)
    # Migration 0005: "host:pid" of the process recording the run (a resume checks it).
    owner: Mapped[str | None] = mapped_column(String(NAME_LENGTH))


class Site(Base):
    """A site (Flower node) in one run; its name is unique within the run."""

    __tablename__ = "sites"
    __table_args__ = (UniqueConstraint("run_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    node_id: Mapped[int] = mapped_column(UInt64)
    partition_id: Mapped[int | None] = mapped_column(Integer)
    num_examples: Mapped[int | None] = mapped_column(BigInteger)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)


class Round(Base):
    """One server step of a run; ``round`` starts at 1 and is unique within the run."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    model_version: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime)
    wall_seconds: Mapped[float] = mapped_column(Double)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    train_loss: Mapped[float | None] = mapped_column(Double)
    num_applied: Mapped[int] = mapped_column(Integer)
    num_dropped: Mapped[int] = mapped_column(Integer)
    num_rejected: Mapped[int] = mapped_column(Integer)
    bytes_up: Mapped[int] = mapped_column(BigInteger)
    bytes_down: Mapped[int] = mapped_column(BigInteger)
    # Migration 0003: the step on the simulated clock.
    virtual_started_at: Mapped[float | None] = mapped_column(Double)
    virtual_finished_at: Mapped[float | None] = mapped_column(Double)


class Checkpoint(Base):
    """The file holding a run's whole state after one committed round (migration 0005).

    Written in the round's transaction; deleted with its file by retention unless ``kept``.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    model_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    kept: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RunEvent(Base):
    """Something that happened to a run besides its rounds (``resumed``), migration 0005."""

    __tablename__ = "run_events"
    __table_args__ = (Index(None, "run_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    kind: Mapped[str] = mapped_column(String(EVENT_KIND_LENGTH))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


def _row_table(
    name: str, row: type, *constraints: SchemaItem, round_nullable: bool = False
) -> Table:
    """The table of a ledger row: an id, its run, its site, the server step, then its columns.

    The row's ``site`` (a name) is stored as ``site_id``; every other column is declared in
    ``row`` and typed by its kind. ``round_nullable``: rows may belong to no server step.
    """
    declared = columns(row)
    return Table(
        name,
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        Column("site_id", ForeignKey("sites.id", ondelete="CASCADE"), nullable=False),
        Column("round", Integer, nullable=round_nullable),
        *(
            Column(spec.name, _SQL_TYPES[facts.kind], nullable=nullable(spec))
            for spec, facts in declared
            if facts.kind is not Kind.SITE
        ),
        *(
            CheckConstraint(_in_clause(spec.name, facts.allowed), name=spec.name)
            for spec, facts in declared
            if facts.kind is Kind.STATUS
        ),
        *constraints,
    )


# The SQL type of each kind of row column (see ``flplatform.core.ledger_rows.Kind``).
_SQL_TYPES: dict[Kind, TypeEngine[Any]] = {
    Kind.STATUS: String(STATUS_LENGTH),
    Kind.COUNT32: Integer(),
    Kind.COUNT64: BigInteger(),
    Kind.WALL_TIME: UTCDateTime(),
    Kind.SECONDS: Double(),
    Kind.DURATION: Double(),
    Kind.MEASURE: Double(),
    Kind.TEXT: Text(),
}


class Update(Base):
    """One site update (``ledger_rows.UpdateColumns``), recorded at the server step
    (``round``) that handled it.

    Migration 0003 added the simulated-clock columns, 0004 those of delayed updates, 0008
    the streaming-sync ``fragment``.
    """

    __table__ = _row_table(
        "updates",
        UpdateColumns,
        # (run_id, round) serves list_updates by round; site_id serves the per-site summary
        # and the cascade from sites.
        Index(None, "run_id", "round"),
        Index(None, "site_id"),
    )


class Evaluation(Base):
    """One site's federated evaluation (``ledger_rows.EvaluationColumns``), recorded at the
    server step (``round``) that handled it; a site is evaluated at most once per step
    (added by migration 0002)."""

    __table__ = _row_table(
        "evaluations",
        EvaluationColumns,
        UniqueConstraint("run_id", "round", "site_id"),
        # (run_id, round) serves list_evaluations and the per-round sums; site_id serves the
        # per-site summary and the cascade from sites.
        Index(None, "run_id", "round"),
        Index(None, "site_id"),
    )


class Traffic(Base):
    """Bytes with one site that no update or evaluation row holds
    (``ledger_rows.TrafficColumns``): site-information queries and late replies, by kind;
    ``round`` is the server step during which they crossed, NULL for those before the first
    step of a run's process (added by migration 0006)."""

    __table__ = _row_table(
        "traffic",
        TrafficColumns,
        # run_id serves the per-run totals, site_id the per-site ones and the cascade.
        Index(None, "run_id"),
        Index(None, "site_id"),
        round_nullable=True,
    )
