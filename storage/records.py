"""Frozen records the ledger repository returns, and the inputs it takes in.

The repository never hands out ORM objects: callers get these plain, immutable dataclasses,
detached from any session, so the CLI, the plots and the tests can hold them as long as they
like. Every record has ``to_dict()`` with JSON-ready values (datetimes as ISO-8601 strings in
UTC), which is what the CLI renders as JSON or CSV.

Two clocks: ``*_at`` datetimes are the wall clock. ``virtual_*`` values (and
``transfer_seconds``, ``simulated_seconds``) are plain float seconds on the simulated clock of a
run that simulated a network, counted from the simulated start of the run (0.0); they are
``None`` for wall-clock runs.

Non-finite floats: JSON has no NaN or Infinity, and SQLite turns a NaN ``REAL`` into ``NULL``
while PostgreSQL keeps it. So that every backend returns the same thing, the ledger stores every
non-finite float (in metrics, config, profiles and float columns) as ``NULL``; records show it as
``None``, meaning "not a finite number". Simulated-clock values are the exception: a non-finite
one is refused (see ``check_seconds``), since ``None`` there means "not simulated".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from flplatform.errors import StorageError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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
EVALUATION_EVALUATED: Final = "evaluated"
EVALUATION_DROPPED: Final = "dropped"
EVALUATION_STATUSES: Final[tuple[EvaluationStatus, ...]] = (
    EVALUATION_EVALUATED,
    EVALUATION_DROPPED,
)

# Bytes and example counts are stored as signed 64-bit integers; rounds, versions and
# staleness as 32-bit ones (the portable SQL INTEGER).
INT64_MAX: Final = 2**63 - 1
INT32_MAX: Final = 2**31 - 1

# The simulated-clock fields of an update (seconds, each None or finite and >= 0).
VIRTUAL_UPDATE_FIELDS: Final = (
    "virtual_dispatched_at",
    "virtual_arrived_at",
    "virtual_compute_seconds",
    "transfer_seconds",
)

# The delayed-compensated-update fields of an update (each None or an integer >= 0): the
# period the update was sent for, the latest global average the site had applied, and
# ``delay = period - 1 - average_applied``. None for every strategy but the delayed one.
DELAY_UPDATE_FIELDS: Final = ("period", "average_applied", "delay")

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
def check_count(what: str, value: object, *, maximum: int = INT64_MAX) -> int:
    """Return ``value`` as an ``int`` if it is an integer in ``[0, maximum]``.

    Parameters
    ----------
    what : str
        How to name the value in the error, e.g. ``"update field 'staleness'"``.
    value : object
        The value to check; ``bool`` is refused even though it is an ``int``.
    maximum : int
        Largest allowed value (the column's range).

    Returns
    -------
    int
        ``value`` converted to a plain ``int`` (NumPy integers are accepted).

    Raises
    ------
    StorageError
        If ``value`` is not an integer or is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StorageError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= maximum:
        raise StorageError(f"{what} must be between 0 and {maximum}, got {int(value)}")
    return int(value)


def check_seconds(what: str, value: object) -> float | None:
    """Return ``value`` as a plain ``float`` if it is ``None`` or a finite number ``>= 0``.

    Used for simulated (virtual) times and durations: seconds since the simulated start of the
    run, or lengths on that clock. Unlike metrics, a non-finite value is refused rather than
    stored as ``None``: a virtual clock that reads NaN is a bug in the simulator, and storing
    it as "no virtual time" would silently switch the run's summaries to the wall clock.

    Parameters
    ----------
    what : str
        How to name the value in the error, e.g. ``"update field 'virtual_arrived_at'"``.
    value : object
        The value to check; ``bool`` is refused even though it is a number.

    Returns
    -------
    float or None
        ``value`` as a plain ``float`` (NumPy scalars are accepted), or ``None``.

    Raises
    ------
    StorageError
        If ``value`` is not ``None``, not a real number, not finite or negative.
    """
    if value is None:
        return None
    allowed = "None or a finite number of seconds >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StorageError(f"{what} must be {allowed}, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise StorageError(f"{what} must be {allowed}, got {number}")
    return number


def _real(what: str, value: object, *, optional: bool) -> float | None:
    """Return ``value`` as a plain ``float`` (``None`` passes if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        allowed = "a number or None" if optional else "a number"
        raise StorageError(f"{what} must be {allowed}, got {type(value).__name__} {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class UpdateInput:
    """One site update as the engine hands it to ``LedgerRepository.record_round``.

    The constructor validates every field and raises ``StorageError`` naming the bad one, so a
    malformed update is caught where it is built rather than half-way through a round's write.

    Parameters
    ----------
    site : str
        Name of a site added to the run with ``add_site``.
    dispatched_round : int
        Server step at which the training instruction was sent.
    version_trained_on : int
        Global model version the site trained on.
    staleness : int
        Versions the global model moved on between dispatch and arrival.
    bytes_up, bytes_down : int
        Payload bytes site to server and server to site.
    status : {"applied", "buffered", "cancelled", "dropped", "rejected"}
        What the server did with the update.
    dispatched_at : float
        Unix time (``time.time()``) of dispatch.
    arrived_at : float or None
        Unix time of arrival; ``None`` when nothing arrived (dropped, cancelled).
    compute_seconds : float or None
        Time the site spent training (virtual or wall, as the engine measures it).
    reason : str or None
        Why the update was dropped, cancelled or rejected.
    num_examples : int or None
        Examples the site trained on.
    train_loss : float or None
        The site's training loss; a non-finite loss is stored as ``None``.
    virtual_dispatched_at, virtual_arrived_at : float or None
        Dispatch and arrival on the simulated clock (seconds since the simulated start of the
        run); ``None`` in a wall-clock run, and arrival ``None`` when nothing arrived. Arrival
        may not precede dispatch.
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
    """

    site: str
    dispatched_round: int
    version_trained_on: int
    staleness: int
    bytes_up: int
    bytes_down: int
    status: UpdateStatus
    dispatched_at: float
    arrived_at: float | None = None
    compute_seconds: float | None = None
    reason: str | None = None
    num_examples: int | None = None
    train_loss: float | None = None
    virtual_dispatched_at: float | None = None
    virtual_arrived_at: float | None = None
    virtual_compute_seconds: float | None = None
    transfer_seconds: float | None = None
    period: int | None = None
    average_applied: int | None = None
    delay: int | None = None

    def __post_init__(self) -> None:
        # Fields are normalised to plain int/float here (NumPy scalars in, Python numbers
        # out) because database drivers cannot bind NumPy types; frozen needs __setattr__.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.site, str) or not self.site.strip():
            raise StorageError(f"update field 'site' must be a non-empty name, got {self.site!r}")
        if self.status not in UPDATE_STATUSES:
            raise StorageError(
                f"update field 'status' is {self.status!r}; allowed: {', '.join(UPDATE_STATUSES)}"
            )
        for name in ("dispatched_round", "version_trained_on", "staleness"):
            put(name, check_count(f"update field {name!r}", getattr(self, name), maximum=INT32_MAX))
        for name in ("bytes_up", "bytes_down"):
            put(name, check_count(f"update field {name!r}", getattr(self, name)))
        if self.num_examples is not None:
            put("num_examples", check_count("update field 'num_examples'", self.num_examples))
        for name in DELAY_UPDATE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                put(name, check_count(f"update field {name!r}", value, maximum=INT32_MAX))
        for name in ("dispatched_at", "arrived_at"):
            when = _real(
                f"update field {name!r}", getattr(self, name), optional=name != "dispatched_at"
            )
            if when is not None and not math.isfinite(when):
                raise StorageError(f"update field {name!r} must be a finite unix time, got {when}")
            put(name, when)
        seconds = _real("update field 'compute_seconds'", self.compute_seconds, optional=True)
        if seconds is not None and seconds < 0:
            raise StorageError(f"update field 'compute_seconds' must be >= 0, got {seconds}")
        put("compute_seconds", seconds)
        put("train_loss", _real("update field 'train_loss'", self.train_loss, optional=True))
        if self.reason is not None and not isinstance(self.reason, str):
            raise StorageError(
                f"update field 'reason' must be a string or None, got {type(self.reason).__name__}"
            )
        for name in VIRTUAL_UPDATE_FIELDS:
            put(name, check_seconds(f"update field {name!r}", getattr(self, name)))
        # The simulated clock only moves forward, so an arrival before its dispatch is a bug in
        # the simulator; it would also make the site's busy time negative.
        sent, came = self.virtual_dispatched_at, self.virtual_arrived_at
        if sent is not None and came is not None and came < sent:
            raise StorageError(
                f"update field 'virtual_arrived_at' ({came}) is before 'virtual_dispatched_at' "
                f"({sent}); the simulated clock only moves forward"
            )


def _finite_or_none(what: str, value: object) -> float | None:
    """Return ``value`` as a plain ``float``, or ``None`` when it is ``None`` or not finite."""
    number = _real(what, value, optional=True)
    return number if number is not None and math.isfinite(number) else None


@dataclass(frozen=True, slots=True)
class EvaluationInput:
    """One site's federated evaluation, as the engine hands it to ``record_round``.

    Recorded at the server step (``round``) that handled it; at most one per site and step.
    The constructor validates every field and raises ``StorageError`` naming the bad one.

    Parameters
    ----------
    site : str
        Name of a site added to the run with ``add_site``.
    model_version : int
        Global model version the site evaluated.
    bytes_up, bytes_down : int
        Serialized sizes of the evaluate reply (site to server) and message (server to site).
    status : {"evaluated", "dropped"}
        Whether a usable evaluation arrived.
    dispatched_at : float
        Unix time (``time.time()``) the evaluate message was sent.
    arrived_at : float or None
        Unix time the reply arrived; ``None`` when nothing arrived.
    reason : str or None
        Why the evaluation was dropped.
    num_examples : int or None
        Examples the site evaluated on.
    loss, accuracy : float or None
        The site's evaluation results; a non-finite value becomes ``None`` here.
    """

    site: str
    model_version: int
    bytes_up: int
    bytes_down: int
    status: EvaluationStatus
    dispatched_at: float
    arrived_at: float | None = None
    reason: str | None = None
    num_examples: int | None = None
    loss: float | None = None
    accuracy: float | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.site, str) or not self.site.strip():
            raise StorageError(
                f"evaluation field 'site' must be a non-empty name, got {self.site!r}"
            )
        if self.status not in EVALUATION_STATUSES:
            raise StorageError(
                f"evaluation field 'status' is {self.status!r}; allowed: "
                f"{', '.join(EVALUATION_STATUSES)}"
            )
        put(
            "model_version",
            check_count("evaluation field 'model_version'", self.model_version, maximum=INT32_MAX),
        )
        for name in ("bytes_up", "bytes_down"):
            put(name, check_count(f"evaluation field {name!r}", getattr(self, name)))
        if self.num_examples is not None:
            put("num_examples", check_count("evaluation field 'num_examples'", self.num_examples))
        for name in ("dispatched_at", "arrived_at"):
            when = _real(
                f"evaluation field {name!r}", getattr(self, name), optional=name != "dispatched_at"
            )
            if when is not None and not math.isfinite(when):
                raise StorageError(
                    f"evaluation field {name!r} must be a finite unix time, got {when}"
                )
            put(name, when)
        for name in ("loss", "accuracy"):
            put(name, _finite_or_none(f"evaluation field {name!r}", getattr(self, name)))
        if self.reason is not None and not isinstance(self.reason, str):
            raise StorageError(
                "evaluation field 'reason' must be a string or None, got "
                f"{type(self.reason).__name__}"
            )


# ---------------------------------------------------------------------------- output
@dataclass(frozen=True, slots=True)
class RunRecord(_Record):
    """One federated run.

    ``rounds_completed`` counts the run's round rows and ``last_metrics`` holds the global
    metrics of its latest round (empty before the first round), so a run listing needs no
    second query. ``network`` is the network preset name or TOML path a simulated run used and
    ``simulated_seconds`` the run's length on the simulated clock; both are ``None`` for a
    wall-clock run (``simulated_seconds`` also while the run has not finished).
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


@dataclass(frozen=True, slots=True)
class UpdateRecord(_Record):
    """One site update as stored, with its site's name joined in.

    The ``virtual_*`` and ``transfer_seconds`` fields are on the simulated clock, as given in
    ``UpdateInput``; ``None`` in a wall-clock run. ``period``, ``average_applied`` and
    ``delay`` are those of a delayed compensated update (see ``UpdateInput``); ``None`` for
    every other strategy and for rows older than migration 0004.
    """

    id: int
    run_id: int
    site_id: int
    site: str
    round: int
    dispatched_round: int
    version_trained_on: int
    staleness: int
    bytes_up: int
    bytes_down: int
    compute_seconds: float | None
    status: UpdateStatus
    reason: str | None
    num_examples: int | None
    train_loss: float | None
    dispatched_at: datetime
    arrived_at: datetime | None
    virtual_dispatched_at: float | None = None
    virtual_arrived_at: float | None = None
    virtual_compute_seconds: float | None = None
    transfer_seconds: float | None = None
    period: int | None = None
    average_applied: int | None = None
    delay: int | None = None


@dataclass(frozen=True, slots=True)
class SiteSummary(_Record):
    """Per-site totals over a run's updates and evaluations.

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


@dataclass(frozen=True, slots=True)
class EvaluationRecord(_Record):
    """One site's federated evaluation as stored, with its site's name joined in."""

    id: int
    run_id: int
    site_id: int
    site: str
    round: int
    model_version: int
    bytes_up: int
    bytes_down: int
    status: EvaluationStatus
    reason: str | None
    num_examples: int | None
    loss: float | None
    accuracy: float | None
    dispatched_at: datetime
    arrived_at: datetime | None
