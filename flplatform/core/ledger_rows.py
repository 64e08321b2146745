"""The ledger's update, evaluation and traffic rows, each column declared once, and their
statuses.

A row is a frozen dataclass whose fields are its columns, in the order the ledger stores them.
Each field's metadata carries the column's ``Kind`` (what it holds, hence its range and SQL
type) and, for a status, the values it allows; a field that defaults to ``None`` is nullable.
Everything else follows from these declarations:

- the engine's events (``flplatform.engine.events.UpdateOutcome``, ``EvaluationOutcome``,
  ``TrafficOutcome``) are ``UpdateRow``, ``EvaluationRow`` and ``TrafficRow`` themselves;
- ``storage`` validates a row once, column by column, when it builds its input from it
  (``storage.records.UpdateInput``; the checks per kind are in ``storage.validators``);
- the SQL tables ``updates``, ``evaluations`` and ``traffic`` are made from the columns
  (``storage.models``), and rows are written and read back by column name
  (``storage.mapping``);
- the records the ledger returns (``storage.records.UpdateRecord``) are the same columns with
  wall-clock instants as datetimes (``UpdateColumns[datetime]``) and the keys the ledger adds.

Two clocks: a ``WALL_TIME`` column is a Unix time (``time.time()``) in a row and an aware UTC
``datetime`` in a record; a ``SECONDS`` column is on the simulated clock of a run that
simulated a network, seconds since its simulated start, and ``None`` on the wall clock.

This module imports neither ``storage`` (the engine writes through ``LedgerSink``) nor Flower,
torch or SQLAlchemy (``storage`` must stay free of the first two).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from enum import Enum
from typing import Any, Final, Generic, Literal, TypeVar

# ---------------------------------------------------------------------------- statuses
RunStatus = Literal["running", "finished", "failed"]
RUN_RUNNING: Final = "running"
RUN_FINISHED: Final = "finished"
RUN_FAILED: Final = "failed"
RUN_STATUSES: Final[tuple[RunStatus, ...]] = (RUN_RUNNING, RUN_FINISHED, RUN_FAILED)
# How a run can end: the statuses ``LedgerRepository.finish_run`` accepts.
FinalRunStatus = Literal["finished", "failed"]

UpdateStatus = Literal["applied", "buffered", "cancelled", "dropped", "rejected"]
UPDATE_APPLIED: Final = "applied"
UPDATE_BUFFERED: Final = "buffered"
UPDATE_CANCELLED: Final = "cancelled"
UPDATE_DROPPED: Final = "dropped"
UPDATE_REJECTED: Final = "rejected"
UPDATE_STATUSES: Final[tuple[UpdateStatus, ...]] = (
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
)

EvaluationStatus = Literal["evaluated", "dropped"]
EVALUATION_EVALUATED: Final = "evaluated"  # an evaluation message answered with metrics
EVALUATION_DROPPED: Final = "dropped"
EVALUATION_STATUSES: Final[tuple[EvaluationStatus, ...]] = (
    EVALUATION_EVALUATED,
    EVALUATION_DROPPED,
)

# The event a resume records (``LedgerRepository.reopen_run``): who resumed the run, and
# from which round.
RESUMED_EVENT: Final = "resumed"

# Traffic that no update or evaluation row holds, by the type of Flower message it was for:
# the site-information queries a site is sent when it joins (``query``), and replies that
# came after the server had stopped waiting for them (an evaluation's, or a training
# message's error); see ``TrafficColumns``.
TrafficKind = Literal["train", "evaluate", "query"]
TRAFFIC_TRAIN: Final = "train"
TRAFFIC_EVALUATE: Final = "evaluate"
TRAFFIC_QUERY: Final = "query"
TRAFFIC_KINDS: Final[tuple[TrafficKind, ...]] = (TRAFFIC_TRAIN, TRAFFIC_EVALUATE, TRAFFIC_QUERY)


# ---------------------------------------------------------------------------- columns
class Kind(Enum):
    """What a column holds: its allowed values, and so its check and its SQL type."""

    SITE = "site"  # a site's name, non-empty; stored as a key to the run's sites
    STATUS = "status"  # one of the column's ``allowed`` values
    COUNT32 = "count32"  # an integer in [0, 2**31 - 1]: rounds, versions, staleness
    COUNT64 = "count64"  # an integer in [0, 2**63 - 1]: bytes, example counts
    WALL_TIME = "wall_time"  # a finite Unix time on the wall clock
    SECONDS = "seconds"  # finite seconds >= 0 on the simulated clock; non-finite is refused
    DURATION = "duration"  # seconds >= 0 as measured; a non-finite one becomes None
    MEASURE = "measure"  # a loss or an accuracy; a non-finite one becomes None
    TEXT = "text"  # free text: why an update or evaluation came to nothing


@dataclass(frozen=True)
class Column:
    """The facts about one column besides its name, type and nullability (the field's)."""

    kind: Kind
    allowed: tuple[str, ...] = ()  # the values of a STATUS column
    not_before: str | None = None  # a column of the same clock this one may not precede


def column(
    kind: Kind, *, allowed: tuple[str, ...] = (), not_before: str | None = None
) -> Mapping[str, Column]:
    """The ``metadata`` of a row field that is a ledger column.

    Parameters
    ----------
    kind : Kind
        What the column holds.
    allowed : tuple[str, ...]
        The values of a ``Kind.STATUS`` column.
    not_before : str or None
        Another column on the same clock that this one may not precede (an arrival may not
        come before its dispatch).

    Returns
    -------
    Mapping[str, Column]
        ``{"column": Column(...)}``, for ``dataclasses.field(metadata=...)``.
    """
    return {"column": Column(kind, allowed, not_before)}


def columns(row_type: type) -> tuple[tuple[Field[Any], Column], ...]:
    """Return the ledger columns of a row type, in the order they are stored.

    Parameters
    ----------
    row_type : type
        A row dataclass, or a record or input deriving from one.

    Returns
    -------
    tuple[tuple[Field, Column], ...]
        Each field declared with ``column()`` and its column facts; other fields (a record's
        keys) are left out. A field is nullable when it defaults to ``None``.
    """
    found = _COLUMNS.get(row_type)
    if found is None:  # once per type: rows are validated and written one by one
        found = tuple((f, f.metadata["column"]) for f in fields(row_type) if "column" in f.metadata)
        _COLUMNS[row_type] = found
    return found


_COLUMNS: dict[type, tuple[tuple[Field[Any], Column], ...]] = {}


def nullable(spec: Field[Any]) -> bool:
    """Whether a row field's column may hold NULL: it does when the field defaults to ``None``."""
    return spec.default is None


# ---------------------------------------------------------------------------- rows
When = TypeVar("When")  # a wall-clock instant: a Unix time (float) in a row, a datetime in a record


@dataclass(frozen=True, kw_only=True)
class SiteColumn:
    """The site a row is about, by name (the ledger stores a key to the run's site)."""

    site: str = field(metadata=column(Kind.SITE))


@dataclass(frozen=True, kw_only=True)
class UpdateColumns(Generic[When]):
    """What became of one training message: the columns of an update row but its site.

    Parameters
    ----------
    dispatched_round : int
        Server step at which the training instruction was sent.
    version_trained_on : int
        Global model version the site trained on.
    staleness : int
        Versions the global model moved on between dispatch and arrival.
    bytes_up, bytes_down : int
        Payload bytes site to server and server to site.
    compute_seconds : float or None
        Time the site spent training (virtual or wall, as the engine measures it).
    status : {"applied", "buffered", "cancelled", "dropped", "rejected"}
        What the server did with the update.
    reason : str or None
        Why the update was dropped, cancelled or rejected.
    num_examples : int or None
        Examples the site trained on.
    train_loss : float or None
        The site's training loss.
    dispatched_at : When
        Dispatch on the wall clock.
    arrived_at : When or None
        Arrival on the wall clock; ``None`` when nothing arrived (dropped, cancelled).
    virtual_dispatched_at, virtual_arrived_at : float or None
        Dispatch and arrival on the simulated clock; ``None`` in a wall-clock run, and arrival
        ``None`` when nothing arrived. Arrival may not precede dispatch.
    virtual_compute_seconds : float or None
        Simulated time the site spent training.
    transfer_seconds : float or None
        Simulated time on the network, download plus upload.
    period : int or None
        Delayed strategy only: the round whose average this update was sent for, which may
        differ from ``dispatched_round`` (a fast site may start period r+1 before the average
        of period r has formed).
    average_applied : int or None
        Delayed strategy only: index of the latest global average the site had swapped into its
        model before computing this update (the model version it was sent).
    delay : int or None
        Delayed strategy only: ``period - 1 - average_applied``, how many rounds old that
        average was (0 is local SGD).
    fragment : int or None
        Streaming sync only: the index of the model fragment the update carried (0-based);
        ``None`` when it carried the whole model.
    """

    dispatched_round: int = field(metadata=column(Kind.COUNT32))
    version_trained_on: int = field(metadata=column(Kind.COUNT32))
    staleness: int = field(metadata=column(Kind.COUNT32))
    bytes_up: int = field(metadata=column(Kind.COUNT64))
    bytes_down: int = field(metadata=column(Kind.COUNT64))
    compute_seconds: float | None = field(default=None, metadata=column(Kind.DURATION))
    status: str = field(metadata=column(Kind.STATUS, allowed=UPDATE_STATUSES))
    reason: str | None = field(default=None, metadata=column(Kind.TEXT))
    num_examples: int | None = field(default=None, metadata=column(Kind.COUNT64))
    train_loss: float | None = field(default=None, metadata=column(Kind.MEASURE))
    dispatched_at: When = field(metadata=column(Kind.WALL_TIME))
    arrived_at: When | None = field(default=None, metadata=column(Kind.WALL_TIME))
    # Migration 0003: the update on the simulated clock.
    virtual_dispatched_at: float | None = field(default=None, metadata=column(Kind.SECONDS))
    virtual_arrived_at: float | None = field(
        default=None, metadata=column(Kind.SECONDS, not_before="virtual_dispatched_at")
    )
    virtual_compute_seconds: float | None = field(default=None, metadata=column(Kind.SECONDS))
    transfer_seconds: float | None = field(default=None, metadata=column(Kind.SECONDS))
    # Migration 0004: delayed compensated updates; None for every other strategy.
    period: int | None = field(default=None, metadata=column(Kind.COUNT32))
    average_applied: int | None = field(default=None, metadata=column(Kind.COUNT32))
    delay: int | None = field(default=None, metadata=column(Kind.COUNT32))
    # Migration 0008: streaming sync; None for strategies that send the whole model.
    fragment: int | None = field(default=None, metadata=column(Kind.COUNT32))


@dataclass(frozen=True, kw_only=True)
class UpdateRow(UpdateColumns[float], SiteColumn):
    """One dispatched training message and what became of it, as the engine reports it.

    Times on the wall clock are Unix times (``time.time()``); the columns are documented in
    ``UpdateColumns``.
    """


@dataclass(frozen=True, kw_only=True)
class EvaluationColumns(Generic[When]):
    """One federated-evaluation message and its reply: the columns of an evaluation row but
    its site. A site is evaluated at most once per server step.

    Parameters
    ----------
    model_version : int
        Global model version the site evaluated.
    bytes_up, bytes_down : int
        Serialized sizes of the evaluate reply (site to server) and message (server to site).
    status : {"evaluated", "dropped"}
        Whether a usable evaluation arrived.
    reason : str or None
        Why the evaluation was dropped.
    num_examples : int or None
        Examples the site evaluated on.
    loss, accuracy : float or None
        The site's evaluation results.
    dispatched_at : When
        When the evaluate message was sent, on the wall clock.
    arrived_at : When or None
        When the reply arrived; ``None`` when nothing arrived.
    """

    model_version: int = field(metadata=column(Kind.COUNT32))
    bytes_up: int = field(metadata=column(Kind.COUNT64))
    bytes_down: int = field(metadata=column(Kind.COUNT64))
    status: str = field(metadata=column(Kind.STATUS, allowed=EVALUATION_STATUSES))
    reason: str | None = field(default=None, metadata=column(Kind.TEXT))
    num_examples: int | None = field(default=None, metadata=column(Kind.COUNT64))
    loss: float | None = field(default=None, metadata=column(Kind.MEASURE))
    accuracy: float | None = field(default=None, metadata=column(Kind.MEASURE))
    dispatched_at: When = field(metadata=column(Kind.WALL_TIME))
    arrived_at: When | None = field(default=None, metadata=column(Kind.WALL_TIME))


@dataclass(frozen=True, kw_only=True)
class EvaluationRow(EvaluationColumns[float], SiteColumn):
    """One federated-evaluation message and its reply, as the engine reports it.

    Times on the wall clock are Unix times (``time.time()``); the columns are documented in
    ``EvaluationColumns``.
    """


@dataclass(frozen=True, kw_only=True)
class TrafficColumns:
    """Bytes on Flower's Fleet API that no update or evaluation row holds: the columns of a
    traffic row but its site.

    An update or evaluation row counts its message and its reply; a traffic row counts the
    rest, so that a run's totals over all three are what the SuperLink reports for it
    (``flplatform.engine.wire``).

    Parameters
    ----------
    kind : {"train", "evaluate", "query"}
        The type of the messages: ``query`` for the site-information queries a site is sent
        when it joins, and their replies; ``train`` or ``evaluate`` for a reply that came
        after the server stopped waiting for it (its message is counted in its own row).
    messages : int
        Messages the server sent that the bytes are for (0 for a late reply alone).
    bytes_up, bytes_down : int
        Bytes site to server and server to site, as Flower's SuperLink counts them.
    """

    kind: str = field(metadata=column(Kind.STATUS, allowed=TRAFFIC_KINDS))
    messages: int = field(metadata=column(Kind.COUNT32))
    bytes_up: int = field(metadata=column(Kind.COUNT64))
    bytes_down: int = field(metadata=column(Kind.COUNT64))


@dataclass(frozen=True, kw_only=True)
class TrafficRow(TrafficColumns, SiteColumn):
    """Traffic with one site that no update or evaluation row holds, as the engine reports
    it; the columns are documented in ``TrafficColumns``."""
