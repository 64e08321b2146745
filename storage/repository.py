"""``LedgerRepository``: the only way the platform reads or writes the ledger database.

Every public method runs in its own transaction and commits before it returns, so a process
that dies mid-run leaves every recorded round readable and its run still ``"running"``. Input
is validated before anything is written, and every database failure surfaces as a
``StorageError`` (or ``NotFoundError``) carrying the masked URL, never as a raw SQLAlchemy
exception.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, cast

from alembic.util import CommandError
from sqlalchemy import Engine, Select, case, func, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from flplatform.errors import FLPlatformError, NotFoundError, StorageError

from .migrations import upgrade_to_head
from .models import NAME_LENGTH, STRATEGY_LENGTH, Evaluation, Round, Run, Site, Update
from .records import (
    CLOCK_VIRTUAL,
    CLOCK_WALL,
    DELAY_UPDATE_FIELDS,
    INT32_MAX,
    INT64_MAX,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_RUNNING,
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    UPDATE_STATUSES,
    VIRTUAL_UPDATE_FIELDS,
    EvaluationInput,
    EvaluationRecord,
    EvaluationStatus,
    FinalRunStatus,
    RoundRecord,
    RunRecord,
    RunStatus,
    SiteRecord,
    SiteSummary,
    UpdateInput,
    UpdateRecord,
    UpdateStatus,
    WaitingClock,
    check_count,
    check_seconds,
)
from .session import (
    URL_HINT,
    create_ledger_engine,
    default_db_url,
    flplatform_home,
    make_session_factories,
    mask_db_url,
    normalize_db_url,
    session_scope,
)

_UINT64_MAX: Final = 2**64 - 1
_JSON_ALLOWED: Final = "str, int, float, bool, None, lists, and dicts with str keys"


# ---------------------------------------------------------------------------- validation
def _describe(exc: BaseException) -> str:
    """One line from a driver error: its first line, whitespace collapsed."""
    original = getattr(exc, "orig", None) or exc
    lines = str(original).strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(original).__name__


def _is_locked(exc: BaseException) -> bool:
    """Whether a driver error says the database stayed locked (SQLite's busy timeout ran out)."""
    return isinstance(exc, OperationalError) and "locked" in str(exc.orig).lower()


def _text(what: str, value: object, *, max_length: int, optional: bool = False) -> str | None:
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


def _free_text(value: str | None) -> str | None:
    """Error text as PostgreSQL can store it: NUL (which it refuses in text) becomes U+FFFD.

    Reasons and errors may quote what a (possibly hostile) site sent, so they are kept rather
    than refused; names and tags are refused instead (see ``_text``).
    """
    return None if value is None else value.replace("\x00", "\ufffd")


def _signed64(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StorageError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not -INT64_MAX - 1 <= int(value) <= INT64_MAX:
        raise StorageError(f"{what} must fit in a signed 64-bit integer, got {int(value)}")
    return int(value)


def _optional_float(what: str, value: object) -> float | None:
    """Return ``value`` as a float, or ``None`` when it is ``None`` or not finite."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StorageError(f"{what} must be a number or None, got {type(value).__name__}")
    number = float(value)
    return number if math.isfinite(number) else None


def _timestamp(what: str, value: object) -> datetime:
    """Convert a unix time (``time.time()``) to an aware UTC datetime."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StorageError(f"{what} must be a unix time in seconds, got {value!r}")
    try:
        return datetime.fromtimestamp(float(value), tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise StorageError(f"{what} must be a finite unix time in seconds, got {value!r}") from None


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


def _json_object(what: str, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise StorageError(f"{what} must be a dict, got {type(value).__name__}")
    return cast(dict[str, Any], _json_safe(what, value))


def _metrics(what: str, value: object) -> dict[str, float | None]:
    """Validate a ``{name: number}`` dict; non-finite values become ``None`` (JSON null)."""
    if not isinstance(value, Mapping):
        raise StorageError(f"{what} must be a dict of metric name to number, got {value!r}")
    result: dict[str, float | None] = {}
    for key, number in value.items():
        if not isinstance(key, str):
            raise StorageError(f"{what} has a metric name {key!r} that is not a string")
        result[key] = _optional_float(f"{what}[{key!r}]", number)
    return result


def _update_statuses(status: str | Iterable[str]) -> list[str]:
    """The statuses an update filter names, each checked against ``UPDATE_STATUSES``."""
    wanted = [status] if isinstance(status, str) else list(status)
    unknown = [s for s in wanted if s not in UPDATE_STATUSES]
    if unknown:
        raise StorageError(
            f"unknown update status {', '.join(repr(s) for s in unknown)}; "
            f"allowed: {', '.join(UPDATE_STATUSES)}"
        )
    return wanted


# ---------------------------------------------------------------------------- summary maths
def nearest_rank_p90(counts: Mapping[int, int]) -> int | None:
    """Return the nearest-rank 90th percentile of a histogram of integer values.

    Parameters
    ----------
    counts : Mapping[int, int]
        Value (a staleness) to how many times it occurred; counts must be ``>= 0``.

    Returns
    -------
    int or None
        The smallest value ``v`` such that at least ``ceil(0.9 * n)`` of the ``n``
        occurrences are ``<= v`` (so always a value that occurred); ``None`` when ``n`` is 0.
    """
    total = sum(counts.values())
    if total == 0:
        return None
    rank = -(-9 * total // 10)  # ceil(0.9 * total) in integers, exact for any total
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise ValueError(f"histogram counts must be >= 0, got {dict(counts)}")


def waiting_and_busy(intervals: Iterable[tuple[float, float | None]]) -> tuple[float, float]:
    """Return how long a site waited for the server and how long it was busy, in seconds.

    Parameters
    ----------
    intervals : Iterable[tuple[float, float or None]]
        ``(dispatched, arrived)`` of each of one site's updates on one clock, in the order
        they were recorded; ``arrived`` is ``None`` when nothing came back.

    Returns
    -------
    tuple[float, float]
        ``(waiting, busy)``. The updates are put in dispatch order (ties keep recording
        order); waiting sums, for each update that arrived and is followed by another, the gap
        from its arrival to the next dispatch, a negative gap (overlapping work) counting as
        0; busy sums ``arrived - dispatched`` over the updates that arrived.
    """
    timeline = sorted(intervals, key=lambda interval: interval[0])  # stable: ties keep order
    waiting = busy = 0.0
    for index, (dispatched, arrived) in enumerate(timeline):
        if arrived is None:
            continue
        busy += arrived - dispatched
        if index + 1 < len(timeline):
            waiting += max(0.0, timeline[index + 1][0] - arrived)
    return waiting, busy


# ---------------------------------------------------------------------------- records
def _run_record(run: Run, rounds_completed: int, last_metrics: dict[str, Any] | None) -> RunRecord:
    return RunRecord(
        id=run.id,
        tag=run.tag,
        name=run.name,
        strategy=run.strategy,
        seed=run.seed,
        config=dict(run.config),
        num_rounds_planned=run.num_rounds_planned,
        status=cast(RunStatus, run.status),
        error=run.error,
        created_at=run.created_at,
        finished_at=run.finished_at,
        wall_seconds=run.wall_seconds,
        final_metrics=None if run.final_metrics is None else dict(run.final_metrics),
        rounds_completed=rounds_completed,
        last_metrics=dict(last_metrics or {}),
        network=run.network,
        simulated_seconds=run.simulated_seconds,
    )


def _site_record(site: Site) -> SiteRecord:
    return SiteRecord(
        id=site.id,
        run_id=site.run_id,
        name=site.name,
        node_id=site.node_id,
        partition_id=site.partition_id,
        num_examples=site.num_examples,
        profile=dict(site.profile),
    )


def _round_record(
    row: Round, eval_bytes_up: Any = None, eval_bytes_down: Any = None
) -> RoundRecord:
    # PostgreSQL returns SUM of BIGINT as NUMERIC (Decimal); no evaluations gives NULL.
    return RoundRecord(
        id=row.id,
        run_id=row.run_id,
        round=row.round,
        model_version=row.model_version,
        started_at=row.started_at,
        finished_at=row.finished_at,
        wall_seconds=row.wall_seconds,
        metrics=dict(row.metrics),
        train_loss=row.train_loss,
        num_applied=row.num_applied,
        num_dropped=row.num_dropped,
        num_rejected=row.num_rejected,
        bytes_up=row.bytes_up,
        bytes_down=row.bytes_down,
        eval_bytes_up=int(eval_bytes_up or 0),
        eval_bytes_down=int(eval_bytes_down or 0),
        virtual_started_at=row.virtual_started_at,
        virtual_finished_at=row.virtual_finished_at,
    )


def _update_record(row: Update, site_name: str) -> UpdateRecord:
    return UpdateRecord(
        id=row.id,
        run_id=row.run_id,
        site_id=row.site_id,
        site=site_name,
        round=row.round,
        dispatched_round=row.dispatched_round,
        version_trained_on=row.version_trained_on,
        staleness=row.staleness,
        bytes_up=row.bytes_up,
        bytes_down=row.bytes_down,
        compute_seconds=row.compute_seconds,
        status=cast(UpdateStatus, row.status),
        reason=row.reason,
        num_examples=row.num_examples,
        train_loss=row.train_loss,
        dispatched_at=row.dispatched_at,
        arrived_at=row.arrived_at,
        virtual_dispatched_at=row.virtual_dispatched_at,
        virtual_arrived_at=row.virtual_arrived_at,
        virtual_compute_seconds=row.virtual_compute_seconds,
        transfer_seconds=row.transfer_seconds,
        period=row.period,
        average_applied=row.average_applied,
        delay=row.delay,
    )


def _evaluation_record(row: Evaluation, site_name: str) -> EvaluationRecord:
    return EvaluationRecord(
        id=row.id,
        run_id=row.run_id,
        site_id=row.site_id,
        site=site_name,
        round=row.round,
        model_version=row.model_version,
        bytes_up=row.bytes_up,
        bytes_down=row.bytes_down,
        status=cast(EvaluationStatus, row.status),
        reason=row.reason,
        num_examples=row.num_examples,
        loss=row.loss,
        accuracy=row.accuracy,
        dispatched_at=row.dispatched_at,
        arrived_at=row.arrived_at,
    )


def _runs_query() -> Select[tuple[Run, int | None, dict[str, Any] | None]]:
    """Runs with their round count and the metrics of their latest round."""
    per_run = (
        select(
            Round.run_id.label("run_id"),
            func.count(Round.id).label("rounds"),
            func.max(Round.round).label("last_round"),
        )
        .group_by(Round.run_id)
        .subquery()
    )
    last = (
        select(Round.run_id, Round.metrics)
        .join(per_run, (per_run.c.run_id == Round.run_id) & (per_run.c.last_round == Round.round))
        .subquery()
    )
    return (
        select(Run, per_run.c.rounds, last.c.metrics)
        .outerjoin(per_run, per_run.c.run_id == Run.id)
        .outerjoin(last, last.c.run_id == Run.id)
    )


# ---------------------------------------------------------------------------- repository
class LedgerRepository:
    """Typed access to the ledger: runs, their sites, rounds, site updates and evaluations.

    Open one with ``LedgerRepository.open(url)``; it migrates the schema to the current
    revision first. Use it as a context manager, or call ``close()``. Every call takes its own
    pooled connection, so threads may share a repository and processes may share a database;
    the exception is an in-memory SQLite ledger (``sqlite://``), whose single connection must
    be used by one thread at a time.

    Parameters
    ----------
    engine : Engine
        An engine whose database is already at the head revision.
    url : str
        The normalized URL of that database.
    """

    def __init__(self, engine: Engine, url: str) -> None:
        self._engine = engine
        self._url = url
        self._read: sessionmaker[Session]
        self._write: sessionmaker[Session]
        self._read, self._write = make_session_factories(engine)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, url: str | None = None) -> LedgerRepository:
        """Open (creating and migrating if needed) the ledger at ``url``.

        Parameters
        ----------
        url : str or None
            A SQLAlchemy URL; a relative SQLite path is taken from the current directory.
            ``None`` opens ``$FLPLATFORM_HOME/ledger.db``, creating the directory.

        Returns
        -------
        LedgerRepository
            A repository over a database at the head revision.

        Raises
        ------
        StorageError
            If the URL is malformed or names an unknown or missing driver, the server is
            unreachable, the path is unwritable, the file is not a database, or the schema
            was written by a newer flplatform.
        """
        if url is None:
            home = flplatform_home()
            try:
                home.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(
                    f"cannot create the ledger directory {home}: {exc.strerror}; set "
                    f"FLPLATFORM_HOME to a writable directory or {URL_HINT}"
                ) from None
            url = default_db_url()
        normalized = normalize_db_url(url)
        engine = create_ledger_engine(normalized)
        try:
            upgrade_to_head(engine)
        except StorageError:
            engine.dispose()
            raise
        except (SQLAlchemyError, CommandError, OSError) as exc:
            engine.dispose()
            shown = mask_db_url(normalized)
            if _is_locked(exc):
                # Only after the busy timeout: another process is legitimately writing (or
                # wedged); a different --db would not help.
                raise StorageError(
                    f"cannot open database {shown!r}: it stayed locked by another process; "
                    "retry when that process has finished writing"
                ) from exc
            raise StorageError(
                f"cannot open database {shown!r}: {_describe(exc)}; {URL_HINT}"
            ) from exc
        return cls(engine, normalized)

    @property
    def url(self) -> str:
        """The normalized URL of the database, password masked (safe to print)."""
        return mask_db_url(self._url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    def close(self) -> None:
        """Release the connections; the repository cannot be used afterwards."""
        self._closed = True
        self._engine.dispose()

    def __enter__(self) -> LedgerRepository:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @contextmanager
    def _session(self, action: str, *, write: bool = False) -> Iterator[Session]:
        """A committed-on-exit session whose database errors become ``StorageError``."""
        if self._closed:
            raise StorageError(f"cannot {action}: the ledger {self.url} is closed")
        try:
            with session_scope(self._write if write else self._read) as session:
                yield session
        except FLPlatformError:
            raise
        except OperationalError as exc:
            if _is_locked(exc):
                raise StorageError(
                    f"cannot {action} in {self.url}: the database stayed locked by another "
                    "process; retry when it has finished writing"
                ) from exc
            raise StorageError(f"cannot {action} in {self.url}: {_describe(exc)}") from exc
        except SQLAlchemyError as exc:
            raise StorageError(f"cannot {action} in {self.url}: {_describe(exc)}") from exc

    def _missing_run(self, run_id: int) -> NotFoundError:
        return NotFoundError(
            f"run {run_id} does not exist; `flplatform history runs` lists the runs in {self.url}"
        )

    def _run_id(self, run_id: object) -> int:
        """Validate a run id; one out of the id range cannot exist."""
        if isinstance(run_id, bool) or not isinstance(run_id, numbers.Integral):
            raise StorageError(f"run id must be an integer, got {run_id!r}")
        if not 1 <= int(run_id) <= INT32_MAX:
            raise self._missing_run(int(run_id))
        return int(run_id)

    def _require_run(self, session: Session, run_id: int) -> Run:
        run = session.get(Run, run_id)
        if run is None:
            raise self._missing_run(run_id)
        return run

    @staticmethod
    def _require_site(session: Session, run_id: int, site: str) -> None:
        names = list(session.scalars(select(Site.name).where(Site.run_id == run_id)))
        if site not in names:
            raise NotFoundError(
                f"run {run_id} has no site {site!r}; its sites: "
                f"{', '.join(sorted(names)) or 'none'}"
            )

    # ------------------------------------------------------------------ runs
    def create_run(
        self,
        *,
        name: str,
        strategy: str,
        seed: int,
        config: dict[str, Any],
        num_rounds_planned: int,
        tag: str | None = None,
        created_at: float | None = None,
        network: str | None = None,
    ) -> int:
        """Record a new run with status ``"running"``.

        Parameters
        ----------
        name : str
            Human-readable run name.
        strategy : str
            Strategy name as the CLI spells it.
        seed : int
            The run's seed (signed 64-bit).
        config : dict[str, Any]
            The run configuration as JSON data; non-finite floats are stored as null.
        num_rounds_planned : int
            Server steps the run intends to take.
        tag : str or None
            External id unique in the ledger, so a separate process can find the run.
        created_at : float or None
            Unix time; ``None`` means now.
        network : str or None
            The network preset name or TOML path the run simulates; ``None`` for a run on the
            wall clock (a real deployment).

        Returns
        -------
        int
            The new run's id.

        Raises
        ------
        StorageError
            If a value is invalid or the tag is already taken.
        """
        row = Run(
            tag=_text("run tag", tag, max_length=NAME_LENGTH, optional=True),
            name=_text("run name", name, max_length=NAME_LENGTH),
            strategy=_text("strategy", strategy, max_length=STRATEGY_LENGTH),
            seed=_signed64("seed", seed),
            config=_json_object("run config", config),
            num_rounds_planned=check_count(
                "num_rounds_planned", num_rounds_planned, maximum=INT32_MAX
            ),
            status=RUN_RUNNING,
            created_at=_timestamp("created_at", time.time() if created_at is None else created_at),
            network=_text("network", network, max_length=NAME_LENGTH, optional=True),
        )
        taken = f"a run tagged {tag!r} already exists in {self.url}; pick another tag"
        with self._session("create a run", write=True) as session:
            if tag is not None and session.scalar(select(Run.id).where(Run.tag == tag)):
                raise StorageError(taken)
            session.add(row)
            try:
                session.flush()
            except IntegrityError:
                # Another process took the tag between our check and our insert.
                raise StorageError(taken) from None
            return row.id

    def finish_run(
        self,
        run_id: int,
        *,
        status: FinalRunStatus,
        error: str | None = None,
        final_metrics: dict[str, float] | None = None,
        finished_at: float | None = None,
        simulated_seconds: float | None = None,
    ) -> None:
        """Mark a running run finished or failed and record its wall (and simulated) time.

        Parameters
        ----------
        run_id : int
            The run.
        status : {"finished", "failed"}
            How it ended.
        error : str or None
            Why it failed.
        final_metrics : dict[str, float] or None
            Final global metrics; non-finite values are stored as null.
        finished_at : float or None
            Unix time; ``None`` means now. ``wall_seconds`` is ``finished_at - created_at``.
        simulated_seconds : float or None
            Simulated elapsed time of the whole run (finite, ``>= 0``); ``None`` for a run
            on the wall clock.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If ``status`` is not allowed, ``simulated_seconds`` is not ``None`` or a finite
            number ``>= 0``, the run is no longer running, or ``finished_at`` is before the
            run was created.
        """
        run_id = self._run_id(run_id)
        if status not in (RUN_FINISHED, RUN_FAILED):
            raise StorageError(
                f"a run can finish with status {RUN_FINISHED!r} or {RUN_FAILED!r}, got {status!r}"
            )
        metrics = None if final_metrics is None else _metrics("final_metrics", final_metrics)
        if error is not None and not isinstance(error, str):
            raise StorageError(f"error must be a string or None, got {type(error).__name__}")
        simulated = check_seconds("simulated_seconds", simulated_seconds)
        end = time.time() if finished_at is None else finished_at
        end_dt = _timestamp("finished_at", end)
        with self._session(f"finish run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            if run.status != RUN_RUNNING:
                raise StorageError(
                    f"run {run_id} is already {run.status}; only a running run can be finished"
                )
            wall = float(end) - run.created_at.timestamp()
            if wall < 0:
                raise StorageError(
                    f"finished_at {end} is before run {run_id} was created "
                    f"({run.created_at.isoformat()})"
                )
            run.status = status
            run.error = _free_text(error)
            run.final_metrics = metrics
            run.finished_at = end_dt
            run.wall_seconds = wall
            run.simulated_seconds = simulated

    def get_run(self, run_id: int) -> RunRecord:
        """Return one run.

        Parameters
        ----------
        run_id : int
            The run.

        Returns
        -------
        RunRecord
            The run with its round count and latest metrics.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        with self._session(f"read run {run_id}") as session:
            row = session.execute(_runs_query().where(Run.id == run_id)).first()
            if row is None:
                raise self._missing_run(run_id)
            return _run_record(row[0], row[1] or 0, row[2])

    def find_run_by_tag(self, tag: str) -> RunRecord | None:
        """Return the run carrying ``tag``, or ``None``.

        Parameters
        ----------
        tag : str
            The external id given to ``create_run``.

        Returns
        -------
        RunRecord or None
            The run, or ``None`` if no run has that tag.
        """
        _text("run tag", tag, max_length=NAME_LENGTH)
        with self._session(f"find the run tagged {tag!r}") as session:
            row = session.execute(_runs_query().where(Run.tag == tag)).first()
            return None if row is None else _run_record(row[0], row[1] or 0, row[2])

    def list_runs(self, *, limit: int | None = None) -> list[RunRecord]:
        """Return runs, newest first.

        Parameters
        ----------
        limit : int or None
            At most this many runs; ``None`` for all.

        Returns
        -------
        list[RunRecord]
            Ordered by ``created_at`` then id, both descending.
        """
        query = _runs_query().order_by(Run.created_at.desc(), Run.id.desc())
        if limit is not None:
            query = query.limit(check_count("limit", limit))
        with self._session("list runs") as session:
            return [
                _run_record(run, rounds or 0, last) for run, rounds, last in session.execute(query)
            ]

    # ------------------------------------------------------------------ sites
    def add_site(
        self,
        run_id: int,
        *,
        name: str,
        node_id: int,
        partition_id: int | None = None,
        num_examples: int | None = None,
        profile: dict[str, Any] | None = None,
    ) -> int:
        """Record a site taking part in a run.

        Parameters
        ----------
        run_id : int
            The run.
        name : str
            Site name, unique within the run.
        node_id : int
            Flower node id, ``0 <= node_id <= 2**64 - 1``.
        partition_id : int or None
            Data partition in simulation.
        num_examples : int or None
            Size of the site's training set.
        profile : dict[str, Any] or None
            Network/compute profile as JSON data.

        Returns
        -------
        int
            The site's id.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If a value is invalid or the run already has a site with this name.
        """
        run_id = self._run_id(run_id)
        row = Site(
            run_id=run_id,
            name=_text("site name", name, max_length=NAME_LENGTH),
            node_id=check_count("node_id", node_id, maximum=_UINT64_MAX),
            partition_id=None
            if partition_id is None
            else check_count("partition_id", partition_id, maximum=INT32_MAX),
            num_examples=None
            if num_examples is None
            else check_count("num_examples", num_examples),
            profile=_json_object("site profile", {} if profile is None else profile),
        )
        taken = f"site {name!r} is already in run {run_id}; site names must be unique in a run"
        with self._session(f"add site {name!r} to run {run_id}", write=True) as session:
            self._require_run(session, run_id)
            exists = select(Site.id).where(Site.run_id == run_id, Site.name == name)
            if session.scalar(exists) is not None:
                raise StorageError(taken)
            session.add(row)
            try:
                session.flush()
            except IntegrityError:
                raise StorageError(taken) from None
            return row.id

    def list_sites(self, run_id: int) -> list[SiteRecord]:
        """Return a run's sites in the order they were added.

        Parameters
        ----------
        run_id : int
            The run.

        Returns
        -------
        list[SiteRecord]
            One record per site; empty if none was added.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        with self._session(f"list the sites of run {run_id}") as session:
            self._require_run(session, run_id)
            rows = session.scalars(select(Site).where(Site.run_id == run_id).order_by(Site.id))
            return [_site_record(site) for site in rows]

    # ------------------------------------------------------------------ rounds
    def record_round(
        self,
        run_id: int,
        *,
        round: int,
        model_version: int,
        started_at: float,
        finished_at: float,
        metrics: dict[str, float],
        train_loss: float | None,
        updates: Sequence[UpdateInput],
        evaluations: Sequence[EvaluationInput] = (),
        virtual_started_at: float | None = None,
        virtual_finished_at: float | None = None,
    ) -> None:
        """Record one server step, every update and evaluation it handled, in one transaction.

        The round's ``bytes_up``, ``bytes_down`` and ``num_applied``/``num_dropped``/
        ``num_rejected`` are computed from ``updates``. Either the round and all its
        updates and evaluations are stored, or nothing is.

        Parameters
        ----------
        run_id : int
            The run.
        round : int
            Server step, starting at 1; each is recorded once.
        model_version : int
            Global model version this step produced.
        started_at, finished_at : float
            Unix times bracketing the step.
        metrics : dict[str, float]
            Global metrics; non-finite values (a diverged loss) are stored as null.
        train_loss : float or None
            Aggregated training loss; non-finite is stored as ``None``.
        updates : Sequence[UpdateInput]
            The site updates handled at this step; each names a site added to the run.
        evaluations : Sequence[EvaluationInput]
            The federated evaluations handled at this step, at most one per site; each names
            a site added to the run.
        virtual_started_at, virtual_finished_at : float or None
            The step on the simulated clock, in seconds since the simulated start of the run
            (finite, ``>= 0``, finish not before start); ``None`` for a wall-clock run.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If a value is invalid, the round is already recorded, an update or evaluation
            names a site the run does not have, or two evaluations name the same site.
        """
        run_id = self._run_id(run_id)
        step = check_count("round", round, maximum=INT32_MAX)
        if step < 1:
            raise StorageError("round must be >= 1 (server steps start at 1), got 0")
        start = _timestamp("started_at", started_at)
        end = _timestamp("finished_at", finished_at)
        if end < start:
            raise StorageError(
                f"round {step}: finished_at {finished_at} is before started_at {started_at}"
            )
        virtual_start = check_seconds("virtual_started_at", virtual_started_at)
        virtual_end = check_seconds("virtual_finished_at", virtual_finished_at)
        if virtual_start is not None and virtual_end is not None and virtual_end < virtual_start:
            raise StorageError(
                f"round {step}: virtual_finished_at {virtual_end} is before virtual_started_at "
                f"{virtual_start}"
            )
        batch = list(updates)
        for index, update in enumerate(batch):
            if not isinstance(update, UpdateInput):
                raise StorageError(
                    f"updates[{index}] must be an UpdateInput, got {type(update).__name__}"
                )
        evals = list(evaluations)
        evaluated: set[str] = set()
        for index, evaluation in enumerate(evals):
            if not isinstance(evaluation, EvaluationInput):
                raise StorageError(
                    f"evaluations[{index}] must be an EvaluationInput, got "
                    f"{type(evaluation).__name__}"
                )
            if evaluation.site in evaluated:
                raise StorageError(
                    f"round {step}: two evaluations from site {evaluation.site!r}; a site is "
                    "evaluated at most once per server step"
                )
            evaluated.add(evaluation.site)
        if max(sum(e.bytes_up for e in evals), sum(e.bytes_down for e in evals)) > INT64_MAX:
            raise StorageError(f"round {step}: total evaluation bytes exceed 2**63 - 1")
        row = Round(
            run_id=run_id,
            round=step,
            model_version=check_count("model_version", model_version, maximum=INT32_MAX),
            started_at=start,
            finished_at=end,
            wall_seconds=float(finished_at) - float(started_at),
            metrics=_metrics("metrics", metrics),
            train_loss=_optional_float("train_loss", train_loss),
            num_applied=sum(u.status == UPDATE_APPLIED for u in batch),
            num_dropped=sum(u.status == UPDATE_DROPPED for u in batch),
            num_rejected=sum(u.status == UPDATE_REJECTED for u in batch),
            bytes_up=sum(u.bytes_up for u in batch),
            bytes_down=sum(u.bytes_down for u in batch),
            virtual_started_at=virtual_start,
            virtual_finished_at=virtual_end,
        )
        if max(row.bytes_up, row.bytes_down) > INT64_MAX:
            raise StorageError(f"round {step}: total bytes exceed 2**63 - 1")
        with self._session(f"record round {step} of run {run_id}", write=True) as session:
            self._require_run(session, run_id)
            done = select(Round.id).where(Round.run_id == run_id, Round.round == step)
            if session.scalar(done) is not None:
                raise StorageError(
                    f"round {step} of run {run_id} is already recorded; each server step is "
                    "recorded once"
                )
            # The round goes in first: if anything below fails, the rollback must take it too.
            session.add(row)
            session.flush()
            site_query = select(Site.name, Site.id).where(Site.run_id == run_id)
            site_ids = {name: site_id for name, site_id in session.execute(site_query)}
            rows: list[dict[str, Any]] = []
            for update in batch:
                if update.site not in site_ids:
                    known = ", ".join(sorted(site_ids)) or "none"
                    raise StorageError(
                        f"round {step}: update from site {update.site!r}, which run {run_id} "
                        f"does not have (its sites: {known}); add it with add_site first"
                    )
                rows.append(self._update_row(run_id, step, site_ids[update.site], update))
            if rows:
                session.execute(insert(Update), rows)
            eval_rows: list[dict[str, Any]] = []
            for evaluation in evals:
                if evaluation.site not in site_ids:
                    known = ", ".join(sorted(site_ids)) or "none"
                    raise StorageError(
                        f"round {step}: evaluation from site {evaluation.site!r}, which run "
                        f"{run_id} does not have (its sites: {known}); add it with add_site first"
                    )
                eval_rows.append(
                    self._evaluation_row(run_id, step, site_ids[evaluation.site], evaluation)
                )
            if eval_rows:
                session.execute(insert(Evaluation), eval_rows)

    @staticmethod
    def _update_row(run_id: int, step: int, site_id: int, update: UpdateInput) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "site_id": site_id,
            "round": step,
            "dispatched_round": update.dispatched_round,
            "version_trained_on": update.version_trained_on,
            "staleness": update.staleness,
            "bytes_up": update.bytes_up,
            "bytes_down": update.bytes_down,
            "compute_seconds": _optional_float("compute_seconds", update.compute_seconds),
            "status": update.status,
            "reason": _free_text(update.reason),
            "num_examples": update.num_examples,
            "train_loss": _optional_float("train_loss", update.train_loss),
            "dispatched_at": _timestamp("dispatched_at", update.dispatched_at),
            "arrived_at": None
            if update.arrived_at is None
            else _timestamp("arrived_at", update.arrived_at),
            **{name: check_seconds(name, getattr(update, name)) for name in VIRTUAL_UPDATE_FIELDS},
            # Already validated by UpdateInput: None or an int in [0, INT32_MAX].
            **{name: getattr(update, name) for name in DELAY_UPDATE_FIELDS},
        }

    @staticmethod
    def _evaluation_row(
        run_id: int, step: int, site_id: int, evaluation: EvaluationInput
    ) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "site_id": site_id,
            "round": step,
            "model_version": evaluation.model_version,
            "bytes_up": evaluation.bytes_up,
            "bytes_down": evaluation.bytes_down,
            "status": evaluation.status,
            "reason": _free_text(evaluation.reason),
            "num_examples": evaluation.num_examples,
            "loss": _optional_float("loss", evaluation.loss),
            "accuracy": _optional_float("accuracy", evaluation.accuracy),
            "dispatched_at": _timestamp("dispatched_at", evaluation.dispatched_at),
            "arrived_at": None
            if evaluation.arrived_at is None
            else _timestamp("arrived_at", evaluation.arrived_at),
        }

    def list_rounds(self, run_id: int) -> list[RoundRecord]:
        """Return a run's rounds ordered by round number.

        Parameters
        ----------
        run_id : int
            The run.

        Returns
        -------
        list[RoundRecord]
            One record per recorded server step, with its evaluation traffic summed in SQL.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        traffic = (
            select(
                Evaluation.round.label("round"),
                func.sum(Evaluation.bytes_up).label("eval_bytes_up"),
                func.sum(Evaluation.bytes_down).label("eval_bytes_down"),
            )
            .where(Evaluation.run_id == run_id)
            .group_by(Evaluation.round)
            .subquery()
        )
        query = (
            select(Round, traffic.c.eval_bytes_up, traffic.c.eval_bytes_down)
            .outerjoin(traffic, traffic.c.round == Round.round)
            .where(Round.run_id == run_id)
            .order_by(Round.round)
        )
        with self._session(f"list the rounds of run {run_id}") as session:
            self._require_run(session, run_id)
            return [_round_record(row, up, down) for row, up, down in session.execute(query)]

    # ------------------------------------------------------------------ updates
    def list_updates(
        self,
        run_id: int,
        *,
        round: int | None = None,
        site: str | None = None,
        status: str | Iterable[str] | None = None,
    ) -> list[UpdateRecord]:
        """Return a run's updates ordered by round, then in the order they were recorded.

        Parameters
        ----------
        run_id : int
            The run.
        round : int or None
            Only the updates handled at this server step.
        site : str or None
            Only this site's updates.
        status : str, iterable of str, or None
            Only updates with this status, or with any of these (``UPDATE_STATUSES``).

        Returns
        -------
        list[UpdateRecord]
            The matching updates, each with its site's name.

        Raises
        ------
        NotFoundError
            If the run does not exist, or ``site`` is not one of its sites.
        StorageError
            If a status is not one of ``UPDATE_STATUSES``.
        """
        run_id = self._run_id(run_id)
        query = (
            select(Update, Site.name)
            .join(Site, Site.id == Update.site_id)
            .where(Update.run_id == run_id)
            .order_by(Update.round, Update.id)
        )
        if round is not None:
            query = query.where(Update.round == check_count("round", round, maximum=INT32_MAX))
        if site is not None:
            query = query.where(Site.name == site)
        if status is not None:
            query = query.where(Update.status.in_(_update_statuses(status)))
        with self._session(f"list the updates of run {run_id}") as session:
            self._require_run(session, run_id)
            if site is not None:
                self._require_site(session, run_id, site)
            return [_update_record(row, name) for row, name in session.execute(query)]

    # ------------------------------------------------------------------ evaluations
    def list_evaluations(
        self, run_id: int, *, round: int | None = None, site: str | None = None
    ) -> list[EvaluationRecord]:
        """Return a run's federated evaluations ordered by round, then as recorded.

        Parameters
        ----------
        run_id : int
            The run.
        round : int or None
            Only the evaluations handled at this server step.
        site : str or None
            Only this site's evaluations.

        Returns
        -------
        list[EvaluationRecord]
            The matching evaluations, each with its site's name.

        Raises
        ------
        NotFoundError
            If the run does not exist, or ``site`` is not one of its sites.
        """
        run_id = self._run_id(run_id)
        query = (
            select(Evaluation, Site.name)
            .join(Site, Site.id == Evaluation.site_id)
            .where(Evaluation.run_id == run_id)
            .order_by(Evaluation.round, Evaluation.id)
        )
        if round is not None:
            step = check_count("round", round, maximum=INT32_MAX)
            query = query.where(Evaluation.round == step)
        if site is not None:
            query = query.where(Site.name == site)
        with self._session(f"list the evaluations of run {run_id}") as session:
            self._require_run(session, run_id)
            if site is not None:
                self._require_site(session, run_id, site)
            return [_evaluation_record(row, name) for row, name in session.execute(query)]

    def site_summaries(self, run_id: int) -> list[SiteSummary]:
        """Return per-site totals over a run's updates and evaluations.

        Counts, sums, means and the staleness histogram are computed in SQL; the waiting and
        busy times, which depend on each update's successor in dispatch order, are computed
        here from each site's dispatch and arrival times (see ``waiting_and_busy``), and the
        90th percentile from the histogram. Staleness and the mean delay cover applied updates
        only (see ``SiteSummary``). Sites with no updates or evaluations are included with zero
        counts. Sites come in the order they were added.

        Parameters
        ----------
        run_id : int
            The run.

        Returns
        -------
        list[SiteSummary]
            One summary per site of the run.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)

        def count(status: str) -> Any:
            return func.sum(case((Update.status == status, 1), else_=0))

        # NULL for every other status, which AVG and MAX skip.
        applied_staleness = case((Update.status == UPDATE_APPLIED, Update.staleness))
        applied_delay = case((Update.status == UPDATE_APPLIED, Update.delay))
        totals = (
            select(
                Update.site_id.label("site_id"),
                func.count(Update.id).label("updates"),
                count(UPDATE_APPLIED).label("applied"),
                count(UPDATE_BUFFERED).label("buffered"),
                count(UPDATE_CANCELLED).label("cancelled"),
                count(UPDATE_DROPPED).label("dropped"),
                count(UPDATE_REJECTED).label("rejected"),
                func.avg(applied_staleness).label("mean_staleness"),
                func.max(applied_staleness).label("max_staleness"),
                # AVG over only NULLs is NULL: "no applied update had a delay".
                func.avg(applied_delay).label("mean_delay"),
                func.sum(Update.bytes_up).label("bytes_up"),
                func.sum(Update.bytes_down).label("bytes_down"),
                func.sum(Update.compute_seconds).label("compute_seconds"),
                func.avg(Update.train_loss).label("mean_train_loss"),
                # SUM over only NULLs is NULL: "no update had a simulated time".
                func.sum(Update.virtual_compute_seconds).label("virtual_compute_seconds"),
                func.sum(Update.transfer_seconds).label("transfer_seconds"),
            )
            .where(Update.run_id == run_id)
            .group_by(Update.site_id)
            .subquery()
        )
        evaluated = (
            select(
                Evaluation.site_id.label("site_id"),
                func.count(Evaluation.id).label("evaluations"),
                func.sum(Evaluation.bytes_up).label("eval_bytes_up"),
                func.sum(Evaluation.bytes_down).label("eval_bytes_down"),
            )
            .where(Evaluation.run_id == run_id)
            .group_by(Evaluation.site_id)
            .subquery()
        )
        query = (
            select(
                Site,
                totals,
                evaluated.c.evaluations,
                evaluated.c.eval_bytes_up,
                evaluated.c.eval_bytes_down,
            )
            .outerjoin(totals, totals.c.site_id == Site.id)
            .outerjoin(evaluated, evaluated.c.site_id == Site.id)
            .where(Site.run_id == run_id)
            .order_by(Site.id)
        )
        histogram = (
            select(Update.site_id, Update.staleness, func.count(Update.id))
            .where(Update.run_id == run_id, Update.status == UPDATE_APPLIED)
            .group_by(Update.site_id, Update.staleness)
        )
        timeline = (
            select(
                Update.site_id,
                Update.dispatched_at,
                Update.arrived_at,
                Update.virtual_dispatched_at,
                Update.virtual_arrived_at,
            )
            .where(Update.run_id == run_id)
            .order_by(Update.id)
        )
        with self._session(f"summarise the sites of run {run_id}") as session:
            self._require_run(session, run_id)
            counts: dict[int, dict[int, int]] = {}
            for site_id, staleness, n in session.execute(histogram):
                counts.setdefault(site_id, {})[int(staleness)] = int(n)
            clock, intervals = _site_intervals(session.execute(timeline))
            summaries = []
            for row in session.execute(query):
                site: Site = row[0]
                t = row._mapping
                by_staleness = dict(sorted(counts.get(site.id, {}).items()))
                waiting, busy = waiting_and_busy(intervals.get(site.id, []))
                # PostgreSQL returns SUM/AVG of integers as NUMERIC (Decimal); normalise.
                summaries.append(
                    SiteSummary(
                        site_id=site.id,
                        name=site.name,
                        node_id=site.node_id,
                        partition_id=site.partition_id,
                        num_examples=site.num_examples,
                        updates=int(t["updates"] or 0),
                        applied=int(t["applied"] or 0),
                        buffered=int(t["buffered"] or 0),
                        cancelled=int(t["cancelled"] or 0),
                        dropped=int(t["dropped"] or 0),
                        rejected=int(t["rejected"] or 0),
                        mean_staleness=_float_or_none(t["mean_staleness"]),
                        max_staleness=None
                        if t["max_staleness"] is None
                        else int(t["max_staleness"]),
                        bytes_up=int(t["bytes_up"] or 0),
                        bytes_down=int(t["bytes_down"] or 0),
                        compute_seconds=float(t["compute_seconds"] or 0.0),
                        mean_train_loss=_float_or_none(t["mean_train_loss"]),
                        evaluations=int(t["evaluations"] or 0),
                        eval_bytes_up=int(t["eval_bytes_up"] or 0),
                        eval_bytes_down=int(t["eval_bytes_down"] or 0),
                        staleness_counts=by_staleness,
                        p90_staleness=nearest_rank_p90(by_staleness),
                        waiting_seconds=waiting,
                        busy_seconds=busy,
                        waiting_clock=clock,
                        virtual_compute_seconds=_float_or_none(t["virtual_compute_seconds"]),
                        transfer_seconds=_float_or_none(t["transfer_seconds"]),
                        mean_delay=_float_or_none(t["mean_delay"]),
                    )
                )
            return summaries


def _float_or_none(value: Any) -> float | None:
    """An aggregate as a ``float`` (PostgreSQL gives ``Decimal`` for integer columns)."""
    return None if value is None else float(value)


def _site_intervals(
    rows: Iterable[tuple[int, datetime, datetime | None, float | None, float | None]],
) -> tuple[WaitingClock, dict[int, list[tuple[float, float | None]]]]:
    """Pick a run's clock and return each site's ``(dispatched, arrived)`` seconds on it.

    The virtual clock is used as soon as any update of the run has a virtual dispatch time:
    in a simulated run the wall times only measure how fast the simulator ran. Updates without
    a virtual dispatch time cannot be placed on that clock and are left out. On the wall clock
    the datetimes become seconds relative to the run's first dispatch, so differences keep
    microsecond precision instead of being taken between two ~1.7e9 floats.

    Parameters
    ----------
    rows : Iterable[tuple]
        ``(site_id, dispatched_at, arrived_at, virtual_dispatched_at, virtual_arrived_at)``
        of every update of the run, in the order they were recorded.

    Returns
    -------
    tuple[WaitingClock, dict[int, list[tuple[float, float or None]]]]
        The clock, and per site id the intervals in recording order.
    """
    rows = list(rows)
    per_site: dict[int, list[tuple[float, float | None]]] = {}
    if any(row[3] is not None for row in rows):
        for site_id, _, _, sent, came in rows:
            if sent is not None:
                per_site.setdefault(site_id, []).append((sent, came))
        return CLOCK_VIRTUAL, per_site
    if rows:
        origin = min(row[1] for row in rows)
        for site_id, sent_at, came_at, _, _ in rows:
            arrived = None if came_at is None else (came_at - origin).total_seconds()
            per_site.setdefault(site_id, []).append(((sent_at - origin).total_seconds(), arrived))
    return CLOCK_WALL, per_site
