"""Frozen records the ledger repository returns, and the rows it takes in.

The repository never hands out ORM objects: callers get these plain, immutable dataclasses,
detached from any session, so the CLI, the plots and the tests can hold them as long as they
like. Every record has ``to_dict()`` with JSON-ready values (datetimes as ISO-8601 strings in
UTC), which is what the CLI renders as JSON or CSV.

The update, evaluation and traffic rows are declared once, in ``flplatform.core.ledger_rows``: the
inputs here are those rows validated on construction (``storage.validators.check_row``), and
``UpdateRecord``, ``EvaluationRecord``, ``TrafficRecord`` are their columns as stored, with
the keys the ledger adds.

Bytes are what Flower's SuperLink counts on its Fleet API (``flplatform.engine.wire``), so a
run's ``bytes_up`` and ``bytes_down`` are what ``flwr ls`` reports for it; runs recorded
before migration 0006 have their payload sizes only.

Two clocks: ``*_at`` datetimes are the wall clock. ``virtual_*`` values (and
``transfer_seconds``, ``simulated_seconds``) are plain float seconds on the simulated clock of a
run that simulated a network, counted from the simulated start of the run (0.0); they are
``None`` for wall-clock runs. A non-finite float is stored as ``None`` ("not a finite number";
see ``storage.validators``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from flplatform.core.errors import StorageError
from flplatform.core.ledger_rows import (
    EvaluationColumns,
    EvaluationRow,
    RunStatus,
    TrafficColumns,
    TrafficRow,
    UpdateColumns,
    UpdateRow,
)

from .validators import PATH_LENGTH, check_count, check_name, check_row

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# ``SiteSummary.waiting_clock``: which clock the waiting and busy times were measured on.
WaitingClock = Literal["virtual", "wall"]
CLOCK_VIRTUAL: Final = "virtual"
CLOCK_WALL: Final = "wall"


def _json_value(value: Any) -> Any:
    """Return ``value`` with datetimes as ISO-8601 strings and containers copied."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    return value


class _Record:
    """Mixin giving dataclass records a JSON-ready ``to_dict()``."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the record's fields as JSON-ready values.

        Returns
        -------
        dict[str, Any]
            Field name to value; datetimes become ISO-8601 strings (UTC, with offset), nested
            dicts are copies, so changing the result never changes the record.
        """
        fields = dataclasses.fields(cast("DataclassInstance", self))
        return {f.name: _json_value(getattr(self, f.name)) for f in fields}


# ---------------------------------------------------------------------------- input
@dataclass(frozen=True, kw_only=True)
class UpdateInput(UpdateRow):
    """One site update as ``LedgerRepository.record_round`` takes it: an ``UpdateRow``
    (the engine's ``UpdateOutcome``) whose every column has been validated.

    The constructor checks each column by its kind and raises ``StorageError`` naming the bad
    one, so a malformed update is caught where it is built rather than half-way through a
    round's write. Values are normalised: NumPy scalars become ``int``/``float``, a non-finite
    ``train_loss`` or ``compute_seconds`` becomes ``None``. The columns are documented in
    ``flplatform.core.ledger_rows.UpdateColumns``; ``site`` names a site added with ``add_site``.
    """

    def __post_init__(self) -> None:
        check_row(self, "update")


@dataclass(frozen=True, kw_only=True)
class EvaluationInput(EvaluationRow):
    """One site's federated evaluation as ``record_round`` takes it: an ``EvaluationRow``
    (the engine's ``EvaluationOutcome``) whose every column has been validated.

    Recorded at the server step (``round``) that handled it; at most one per site and step.
    The constructor validates every column and raises ``StorageError`` naming the bad one; a
    non-finite ``loss`` or ``accuracy`` becomes ``None``. The columns are documented in
    ``flplatform.core.ledger_rows.EvaluationColumns``.
    """

    def __post_init__(self) -> None:
        check_row(self, "evaluation")


@dataclass(frozen=True, kw_only=True)
class TrafficInput(TrafficRow):
    """Bytes with one site that no update or evaluation row holds, as
    ``LedgerRepository.add_traffic`` takes them: a ``TrafficRow`` (the engine's
    ``TrafficOutcome``) whose every column has been validated (``StorageError`` naming the bad
    one). The columns are documented in ``flplatform.core.ledger_rows.TrafficColumns``; ``site``
    names a site added with ``add_site``.
    """

    def __post_init__(self) -> None:
        check_row(self, "traffic")


@dataclass(frozen=True, kw_only=True)
class CheckpointInput:
    """The checkpoint file of a round, as ``record_round`` takes it with the round.

    ``path`` is where the file was written (absolute, so any process finds it), ``size_bytes``
    its size; ``kept``: retention keeps it (every N rounds, the final one) when later rounds
    are committed. The round and model version are the round's. Validated on construction
    (``StorageError`` naming the bad field).
    """

    path: str
    size_bytes: int
    kept: bool = False

    def __post_init__(self) -> None:
        check_name("checkpoint path", self.path, max_length=PATH_LENGTH)
        object.__setattr__(self, "size_bytes", check_count("checkpoint size", self.size_bytes))
        if not isinstance(self.kept, bool):
            raise StorageError(f"checkpoint kept must be True or False, got {self.kept!r}")


# ---------------------------------------------------------------------------- output
@dataclass(frozen=True, slots=True)
class RunRecord(_Record):
    """One federated run.

    ``rounds_completed`` counts the run's round rows and ``last_metrics`` holds the global
    metrics of its latest round (empty before the first round), so a run listing needs no
    second query. ``network`` is the network preset name or TOML path a simulated run used and
    ``simulated_seconds`` the run's length on the simulated clock; both are ``None`` for a
    wall-clock run (``simulated_seconds`` also while the run has not finished). ``error`` is
    why the run failed, and a warning noted while it ran (training diverged), which a
    finished run keeps too. ``owner`` is ``"host:pid"`` of the process recording the run
    (``None`` for runs older than migration 0005). ``bytes_up`` and ``bytes_down`` are every
    byte of the run each way: its updates, evaluations and traffic rows (see the module's
    note on bytes).
    """

    id: int
    tag: str | None
    name: str
    strategy: str
    seed: int
    config: dict[str, Any]
    num_rounds_planned: int
    status: RunStatus
    error: str | None
    created_at: datetime
    finished_at: datetime | None
    wall_seconds: float | None
    final_metrics: dict[str, float | None] | None
    rounds_completed: int = 0
    last_metrics: dict[str, float | None] = field(default_factory=dict)
    network: str | None = None
    simulated_seconds: float | None = None
    owner: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointRecord(_Record):
    """The checkpoint file of one committed round of a run.

    ``path`` is the file (the ledger keeps the row only while the file is meant to exist:
    retention deletes both), ``size_bytes`` its size when written, ``kept`` whether
    retention keeps it (every N rounds, and the final one of a finished run); the latest
    checkpoint of a run is its resume point, kept or not.
    """

    id: int
    run_id: int
    round: int
    model_version: int
    path: str
    size_bytes: int
    kept: bool
    created_at: datetime


@dataclass(frozen=True, slots=True)
class RunEventRecord(_Record):
    """Something that happened to a run besides its rounds: its ``kind`` (``"resumed"``),
    when (wall clock, UTC) and what the recorder said about it (``detail``, JSON data)."""

    id: int
    run_id: int
    at: datetime
    kind: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SiteRecord(_Record):
    """One site (a Flower node) taking part in a run.

    ``node_id`` is Flower's unsigned 64-bit node id, exactly as it was given.
    """

    id: int
    run_id: int
    name: str
    node_id: int
    partition_id: int | None
    num_examples: int | None
    profile: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RoundRecord(_Record):
    """One server step: the global metrics and the traffic of the updates it handled.

    ``bytes_up``, ``bytes_down`` and the ``num_*`` counts are computed from the round's
    updates when it is recorded; ``eval_bytes_up``, ``eval_bytes_down`` are the sums over the
    round's federated evaluations, computed when read (0 when it had none).
    ``virtual_started_at``, ``virtual_finished_at`` bracket the step on the simulated clock
    (``None`` in a wall-clock run).
    """

    id: int
    run_id: int
    round: int
    model_version: int
    started_at: datetime
    finished_at: datetime
    wall_seconds: float
    metrics: dict[str, float | None]
    train_loss: float | None
    num_applied: int
    num_dropped: int
    num_rejected: int
    bytes_up: int
    bytes_down: int
    eval_bytes_up: int = 0
    eval_bytes_down: int = 0
    virtual_started_at: float | None = None
    virtual_finished_at: float | None = None


@dataclass(frozen=True, kw_only=True)
class StoredRowKeys:
    """What the ledger adds to an update or evaluation row it stores: the row's id, its run,
    its site (by id, with the site's name joined in) and the server step that handled it."""

    id: int
    run_id: int
    site_id: int
    site: str
    round: int


@dataclass(frozen=True, kw_only=True)
class UpdateRecord(_Record, UpdateColumns[datetime], StoredRowKeys):
    """One site update as stored: its keys, then the columns of ``UpdateColumns`` with the
    wall-clock times as datetimes.

    The ``virtual_*`` and ``transfer_seconds`` fields are on the simulated clock; ``None`` in a
    wall-clock run. ``period``, ``average_applied`` and ``delay`` are those of a delayed
    compensated update; ``None`` for every other strategy and for rows older than migration
    0004. ``fragment`` is the model fragment a streaming-sync update carried; ``None`` for
    updates of the whole model and for rows older than migration 0008.
    """


@dataclass(frozen=True, slots=True)
class SiteSummary(_Record):
    """Per-site totals over a run's updates, evaluations and traffic.

    Counts, bytes, compute time and ``mean_train_loss`` cover every update, whatever its
    status; ``mean_train_loss`` is ``None`` when no update reported a finite loss, and
    ``compute_seconds`` is the sum over updates that reported it (0.0 when none did).

    Staleness covers **applied** updates only, since only they moved the global model (a
    dropped or rejected update's staleness says nothing about the model the site hurt or
    helped). ``staleness_counts`` maps each staleness to how many applied updates had it, in
    ascending order of staleness; ``mean_staleness``, ``max_staleness`` and ``p90_staleness``
    summarise it and are ``None`` when the site had no applied update. ``p90_staleness`` is the
    nearest-rank 90th percentile: the smallest staleness that at least 90 % of the applied
    updates do not exceed, so it is always a staleness that occurred. In ``to_dict()``
    ``staleness_counts`` becomes a list of ``[staleness, count]`` pairs, so its keys stay
    integers through JSON (whose object keys can only be strings).

    ``waiting_seconds`` is how long the site sat idle waiting for the server: over the site's
    updates ordered by dispatch time, the gap from each arrival to the next dispatch, summed
    (a negative gap, an overlap, counts as 0; an update that never arrived, and the last one,
    contribute nothing). ``busy_seconds`` sums arrival minus dispatch over updates that
    arrived. Both use the clock named by ``waiting_clock``: ``"virtual"`` when any update of
    the run has a virtual dispatch time (updates without one are then left out), else
    ``"wall"``. ``virtual_compute_seconds`` and ``transfer_seconds`` are sums over the updates
    that have them, ``None`` when none does.

    ``mean_delay`` is the mean ``delay`` (how many rounds old the global average was) over the
    site's **applied** updates that have one, like staleness; ``None`` when none has one, as
    for every strategy but the delayed one.

    ``evaluations`` counts the site's federated evaluations (any status) and
    ``eval_bytes_up``, ``eval_bytes_down`` sum their traffic (0 when it had none).
    ``queries`` counts the site-information queries it was sent, ``query_bytes_up`` and
    ``query_bytes_down`` sum their traffic and their replies'. ``total_bytes_up`` and
    ``total_bytes_down`` are all its traffic: updates, evaluations and every traffic row
    (late replies included).
    """

    site_id: int
    name: str
    node_id: int
    partition_id: int | None
    num_examples: int | None
    updates: int
    applied: int
    buffered: int
    cancelled: int
    dropped: int
    rejected: int
    mean_staleness: float | None
    max_staleness: int | None
    bytes_up: int
    bytes_down: int
    compute_seconds: float
    mean_train_loss: float | None
    evaluations: int = 0
    eval_bytes_up: int = 0
    eval_bytes_down: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict)
    p90_staleness: int | None = None
    waiting_seconds: float = 0.0
    busy_seconds: float = 0.0
    waiting_clock: WaitingClock = CLOCK_WALL
    virtual_compute_seconds: float | None = None
    transfer_seconds: float | None = None
    mean_delay: float | None = None
    queries: int = 0
    query_bytes_up: int = 0
    query_bytes_down: int = 0
    total_bytes_up: int = 0
    total_bytes_down: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the summary's fields as JSON-ready values.

        Returns
        -------
        dict[str, Any]
            As ``_Record.to_dict``, with ``staleness_counts`` as ``[staleness, count]`` pairs
            in ascending order of staleness.
        """
        # Not super(): zero-argument super() breaks in slots dataclasses before Python 3.14.
        data = _Record.to_dict(self)
        data["staleness_counts"] = [[k, v] for k, v in sorted(self.staleness_counts.items())]
        return data


@dataclass(frozen=True, kw_only=True)
class EvaluationRecord(_Record, EvaluationColumns[datetime], StoredRowKeys):
    """One site's federated evaluation as stored: its keys, then the columns of
    ``EvaluationColumns`` with the wall-clock times as datetimes."""


@dataclass(frozen=True, kw_only=True)
class StoredTrafficKeys:
    """What the ledger adds to a traffic row it stores: the row's id, its run, its site (by
    id, with the site's name joined in) and the server step during which the bytes crossed
    (``None``: before the first step of a run's process)."""

    id: int
    run_id: int
    site_id: int
    site: str
    round: int | None


@dataclass(frozen=True, kw_only=True)
class TrafficRecord(_Record, TrafficColumns, StoredTrafficKeys):
    """Bytes with one site that no update or evaluation row holds, as stored: its keys, then
    the columns of ``TrafficColumns``."""
