"""The checks on every value the ledger takes in: each raises ``StorageError`` naming the value.

``check_row`` validates an update or evaluation row column by column from its declaration in
``flplatform.core.ledger_rows`` (one check per ``Kind``); the other functions check the arguments of
the repository's methods (names, ids, metrics, JSON documents). Values are returned normalised
to plain ``int``/``float`` (NumPy scalars in, Python numbers out), because database drivers
cannot bind NumPy types.

Non-finite floats: JSON has no NaN or Infinity, and SQLite turns a NaN ``REAL`` into ``NULL``
while PostgreSQL keeps it. So that every backend returns the same thing, a non-finite metric,
config value, profile value, loss or measured duration becomes ``None``, meaning "not a finite
number". Simulated-clock values are the exception: a non-finite one is refused (see
``check_seconds``), since ``None`` there means "not simulated".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, TypeVar, cast

from flplatform.core.errors import StorageError
from flplatform.core.ledger_rows import (
    TRAFFIC_KINDS,
    UPDATE_STATUSES,
    Column,
    EvaluationRow,
    Kind,
    TrafficRow,
    UpdateRow,
    columns,
    nullable,
)

# Bytes and example counts are stored as signed 64-bit integers; rounds, versions and
# staleness as 32-bit ones (the portable SQL INTEGER); Flower node ids are unsigned 64-bit.
INT64_MAX: Final = 2**63 - 1
INT32_MAX: Final = 2**31 - 1
UINT64_MAX: Final = 2**64 - 1
# Longest checkpoint path taken (PATH_MAX on Linux).
PATH_LENGTH: Final = 4096

R = TypeVar("R")

_JSON_ALLOWED: Final = "str, int, float, bool, None, lists, and dicts with str keys"


# ---------------------------------------------------------------------------- numbers
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


def real(what: str, value: object, *, optional: bool) -> float | None:
    """Return ``value`` as a plain ``float`` (``None`` passes if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        allowed = "a number or None" if optional else "a number"
        raise StorageError(f"{what} must be {allowed}, got {type(value).__name__} {value!r}")
    return float(value)


def finite_or_none(what: str, value: object) -> float | None:
    """Return ``value`` as a plain ``float``, or ``None`` when it is ``None`` or not finite."""
    number = real(what, value, optional=True)
    return number if number is not None and math.isfinite(number) else None


def check_signed64(what: str, value: object) -> int:
    """Return ``value`` as an ``int`` if it fits in a signed 64-bit integer (a seed)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StorageError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not -INT64_MAX - 1 <= int(value) <= INT64_MAX:
        raise StorageError(f"{what} must fit in a signed 64-bit integer, got {int(value)}")
    return int(value)


def to_datetime(what: str, value: object) -> datetime:
    """Convert a unix time (``time.time()``) to an aware UTC datetime."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StorageError(f"{what} must be a unix time in seconds, got {value!r}")
    try:
        return datetime.fromtimestamp(float(value), tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise StorageError(f"{what} must be a finite unix time in seconds, got {value!r}") from None


# ---------------------------------------------------------------------------- text
def check_name(what: str, value: object, *, max_length: int, optional: bool = False) -> str | None:
    """Return ``value`` if it is a non-empty string of at most ``max_length`` characters."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise StorageError(f"{what} must be a non-empty string, got {value!r}")
    if "\x00" in value:
        raise StorageError(f"{what} must not contain NUL characters, got {value!r}")
    if len(value) > max_length:
        raise StorageError(f"{what} must be at most {max_length} characters, got {len(value)}")
    return value


def free_text(value: str | None) -> str | None:
    """Error text as PostgreSQL can store it: NUL (which it refuses in text) becomes U+FFFD.

    Reasons and errors may quote what a (possibly hostile) site sent, so they are kept rather
    than refused; names and tags are refused instead (see ``check_name``).
    """
    return None if value is None else value.replace("\x00", "\ufffd")


# ---------------------------------------------------------------------------- JSON
def _json_safe(what: str, value: object) -> Any:
    """Return ``value`` as plain JSON data, non-finite floats replaced by ``None``.

    NumPy scalars become ``int``/``float`` (they are ``numbers.Integral``/``Real``) because
    ``json`` cannot encode most of them.
    """
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        result: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise StorageError(
                    f"{what} has a key {key!r} that is not a string; {_JSON_ALLOWED}"
                )
            result[key] = _json_safe(f"{what}[{key!r}]", item)
        return result
    if isinstance(value, list | tuple):
        return [_json_safe(f"{what}[{index}]", item) for index, item in enumerate(value)]
    raise StorageError(
        f"{what} is a {type(value).__name__}; the ledger stores JSON values only: {_JSON_ALLOWED}"
    )


def check_json_object(what: str, value: object) -> dict[str, Any]:
    """Return ``value`` as a JSON object (a run's config, a site's profile)."""
    if not isinstance(value, Mapping):
        raise StorageError(f"{what} must be a dict, got {type(value).__name__}")
    return cast(dict[str, Any], _json_safe(what, value))


def check_metrics(what: str, value: object) -> dict[str, float | None]:
    """Validate a ``{name: number}`` dict; non-finite values become ``None`` (JSON null)."""
    if not isinstance(value, Mapping):
        raise StorageError(f"{what} must be a dict of metric name to number, got {value!r}")
    result: dict[str, float | None] = {}
    for key, number in value.items():
        if not isinstance(key, str):
            raise StorageError(f"{what} has a metric name {key!r} that is not a string")
        result[key] = finite_or_none(f"{what}[{key!r}]", number)
    return result


def check_update_statuses(status: str | Iterable[str]) -> list[str]:
    """The statuses an update filter names, each checked against ``UPDATE_STATUSES``."""
    return _checked_choices(status, UPDATE_STATUSES, "update status")


def check_traffic_kinds(kind: str | Iterable[str]) -> list[str]:
    """The kinds a traffic filter names, each checked against ``TRAFFIC_KINDS``."""
    return _checked_choices(kind, TRAFFIC_KINDS, "traffic kind")


def _checked_choices(value: str | Iterable[str], allowed: Sequence[str], noun: str) -> list[str]:
    """``value`` (one or several) as a list; ``StorageError`` naming those not ``allowed``."""
    wanted = [value] if isinstance(value, str) else list(value)
    unknown = [v for v in wanted if v not in allowed]
    if unknown:
        raise StorageError(
            f"unknown {noun} {', '.join(repr(v) for v in unknown)}; allowed: {', '.join(allowed)}"
        )
    return wanted


# ---------------------------------------------------------------------------- a round
def check_wall_span(step: int, started_at: float, finished_at: float) -> tuple[datetime, datetime]:
    """A step's start and finish as datetimes; the finish may not precede the start."""
    start = to_datetime("started_at", started_at)
    end = to_datetime("finished_at", finished_at)
    if end < start:
        raise StorageError(
            f"round {step}: finished_at {finished_at} is before started_at {started_at}"
        )
    return start, end


def check_virtual_span(
    step: int, started_at: float | None, finished_at: float | None
) -> tuple[float | None, float | None]:
    """A step's start and finish on the simulated clock; the finish may not precede the start."""
    start = check_seconds("virtual_started_at", started_at)
    end = check_seconds("virtual_finished_at", finished_at)
    if start is not None and end is not None and end < start:
        raise StorageError(
            f"round {step}: virtual_finished_at {end} is before virtual_started_at {start}"
        )
    return start, end


def check_rows(what: str, given: Sequence[Any], expected: type[R]) -> list[R]:
    """The rows as a list, each checked to be an ``expected`` (an input validated when built)."""
    rows = list(given)
    for index, row in enumerate(rows):
        if not isinstance(row, expected):
            raise StorageError(
                f"{what}[{index}] must be an {expected.__name__}, got {type(row).__name__}"
            )
    return rows


def check_one_evaluation_per_site(step: int, evaluations: Sequence[EvaluationRow]) -> None:
    """A site is evaluated at most once per server step."""
    evaluated: set[str] = set()
    for evaluation in evaluations:
        if evaluation.site in evaluated:
            raise StorageError(
                f"round {step}: two evaluations from site {evaluation.site!r}; a site is "
                "evaluated at most once per server step"
            )
        evaluated.add(evaluation.site)


def check_total_bytes(
    step: int | None,
    what: str,
    rows: Sequence[UpdateRow] | Sequence[EvaluationRow] | Sequence[TrafficRow],
) -> None:
    """A step's bytes each way must fit a BIGINT (the round's column, the per-site sums)."""
    if max(sum(r.bytes_up for r in rows), sum(r.bytes_down for r in rows)) > INT64_MAX:
        where = "" if step is None else f"round {step}: "
        raise StorageError(f"{where}{what} exceed 2**63 - 1")


# ---------------------------------------------------------------------------- rows
def _column_value(what: str, value: object, facts: Column) -> object:
    """One column's value checked and normalised by its kind (see ``ledger_rows.Kind``)."""
    match facts.kind:
        case Kind.SITE:
            if not isinstance(value, str) or not value.strip():
                raise StorageError(f"{what} must be a non-empty name, got {value!r}")
            return value
        case Kind.STATUS:
            if value not in facts.allowed:
                raise StorageError(f"{what} is {value!r}; allowed: {', '.join(facts.allowed)}")
            return value
        case Kind.TEXT:
            if not isinstance(value, str):
                raise StorageError(f"{what} must be a string or None, got {type(value).__name__}")
            return value
        case Kind.COUNT32:
            return check_count(what, value, maximum=INT32_MAX)
        case Kind.COUNT64:
            return check_count(what, value, maximum=INT64_MAX)
        case Kind.WALL_TIME:
            when = cast(float, real(what, value, optional=False))
            if not math.isfinite(when):
                raise StorageError(f"{what} must be a finite unix time, got {when}")
            return when
        case Kind.SECONDS:
            return check_seconds(what, value)
        case Kind.DURATION:
            seconds = cast(float, real(what, value, optional=True))
            if seconds < 0:
                raise StorageError(f"{what} must be >= 0, got {seconds}")
            return seconds if math.isfinite(seconds) else None
        case Kind.MEASURE:
            return finite_or_none(what, value)


def check_row(row: object, noun: str) -> None:
    """Validate a ledger row in place, column by column, normalising each value.

    Parameters
    ----------
    row : object
        A frozen row dataclass (``storage.records.UpdateInput`` while it is built); its
        fields are replaced by their normalised values.
    noun : str
        How the row is named in errors: ``"update"``, ``"evaluation"`` or ``"traffic"``.

    Raises
    ------
    StorageError
        Naming the first column whose value its kind does not allow, or a column that precedes
        the one it may not (a simulated arrival before its dispatch).
    """
    declared = columns(type(row))
    for spec, facts in declared:
        value = getattr(row, spec.name)
        if value is not None or not nullable(spec):
            value = _column_value(f"{noun} field {spec.name!r}", value, facts)
        object.__setattr__(row, spec.name, value)  # frozen: set through object
    for spec, facts in declared:
        later, earlier = getattr(row, spec.name), getattr(row, facts.not_before or spec.name)
        if facts.not_before and later is not None and earlier is not None and later < earlier:
            # The simulated clock only moves forward, so an arrival before its dispatch is a
            # bug in the simulator; it would also make the site's busy time negative.
            raise StorageError(
                f"{noun} field {spec.name!r} ({later}) is before {facts.not_before!r} "
                f"({earlier}); the simulated clock only moves forward"
            )
