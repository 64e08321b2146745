"""``LedgerRepository``: the only way the platform reads or writes the ledger database.

Every public method runs in its own transaction and commits before it returns, so a process
that dies mid-run leaves every recorded round readable and its run still ``"running"``; reads
that must agree (a run and its rounds) go through ``snapshot()``, one read transaction. Input
is validated before anything is written (``storage.validators``), and every database failure
surfaces as a ``StorageError`` (or ``NotFoundError``) carrying the masked URL, never as a raw
SQLAlchemy exception. Rows are mapped to records in ``storage.mapping`` and the per-site
totals are computed in ``storage.summaries``.
"""

from __future__ import annotations

import copy
import numbers
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

from alembic.util import CommandError
from sqlalchemy import ColumnElement, Engine, Table, insert, select, text
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from flplatform.core.errors import FLPlatformError, NotFoundError, StorageError
from flplatform.core.ledger_rows import (
    RESUMED_EVENT,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_RUNNING,
    UPDATE_APPLIED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    FinalRunStatus,
)

from .mapping import row_values, to_record
from .migrations import VERSION_TABLE, SchemaUpgrade, schema_objects, upgrade_to_head
from .models import (
    EVENT_KIND_LENGTH,
    NAME_LENGTH,
    STRATEGY_LENGTH,
    Base,
    Checkpoint,
    Evaluation,
    Round,
    Run,
    RunEvent,
    Site,
    Traffic,
    Update,
)
from .records import (
    CheckpointInput,
    CheckpointRecord,
    EvaluationInput,
    EvaluationRecord,
    RoundRecord,
    RunEventRecord,
    RunRecord,
    SiteRecord,
    SiteSummary,
    TrafficInput,
    TrafficRecord,
    UpdateInput,
    UpdateRecord,
)
from .session import (
    PASSWORD_ENV,
    SQLITE_BEGIN_OPTION,
    URL_HINT,
    create_ledger_engine,
    default_db_url,
    flplatform_home,
    is_in_memory,
    ledger_id,
    make_session_factories,
    mask_db_url,
    normalize_db_url,
    session_scope,
    sqlite_file,
)
from .summaries import round_record, rounds_query, run_record, runs_query, site_summaries
from .validators import (
    INT32_MAX,
    UINT64_MAX,
    check_count,
    check_json_object,
    check_metrics,
    check_name,
    check_one_evaluation_per_site,
    check_rows,
    check_seconds,
    check_signed64,
    check_total_bytes,
    check_traffic_kinds,
    check_update_statuses,
    check_virtual_span,
    check_wall_span,
    finite_or_none,
    free_text,
    to_datetime,
)

Row = TypeVar("Row", UpdateRecord, EvaluationRecord)

# libpq's words for a login refused for a missing or a wrong password.
_PASSWORD_REFUSED = ("no password supplied", "password authentication failed")


def _describe(exc: BaseException) -> str:
    """One line from a driver error: its first line, whitespace collapsed."""
    original = getattr(exc, "orig", None) or exc
    lines = str(original).strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(original).__name__


def _why(exc: BaseException, path: Path | None) -> str:
    """What a driver error says; for a SQLite file it could not write, which permission;
    for a PostgreSQL login refused for its password, where the password comes from."""
    reason = _describe(exc)
    if any(s in reason for s in _PASSWORD_REFUSED):
        return (
            f"{reason} (the password comes from the URL, {PASSWORD_ENV}, the file "
            "PGPASSFILE names, or ~/.pgpass)"
        )
    if path is None or not any(s in reason.lower() for s in ("readonly", "unable to open")):
        return reason
    if path.exists() and not os.access(path, os.W_OK):
        return f"the file {path} is read-only"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        # SQLite writes its log (-wal, -shm) beside the ledger, even to read one in WAL mode.
        return f"its directory {path.parent} is not writable"
    return reason


def _check_is_ledger(url: str, shown: str, *, create: bool) -> None:
    """Refuse a database that holds something other than a ledger (or, to a reader, nothing).

    Looked at through an engine that does not switch SQLite to WAL: the switch rewrites the
    file's header, and another application's file must be left byte for byte as it was.
    """
    probe = create_ledger_engine(url, wal=False)
    try:
        found = schema_objects(probe)
    finally:
        probe.dispose()
    if VERSION_TABLE in found:
        return
    if found:
        named = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise StorageError(
            f"database {shown!r} is not a flplatform ledger: it holds another application's "
            f"tables ({named}), and was left unchanged; {URL_HINT} (a new file or an empty "
            "database)"
        )
    if not create:
        raise StorageError(
            f"no ledger in {shown!r}: the database is empty (flplatform simulate, run and "
            f"demo record runs there); {URL_HINT} to read another ledger"
        )


def _is_locked(exc: BaseException) -> bool:
    """Whether a driver error says the database stayed locked (SQLite's busy timeout ran out)."""
    return isinstance(exc, OperationalError) and "locked" in str(exc.orig).lower()


# ---------------------------------------------------------------------------- repository
class LedgerRepository:
    """Typed access to the ledger: runs, their sites, rounds, site updates, evaluations and
    the traffic no update or evaluation holds.

    Open one with ``LedgerRepository.open(url)``; it migrates the schema to the current
    revision first (``schema_upgrade`` says when that changed an existing ledger). Use it as a
    context manager, or call ``close()``. Every call takes its own pooled connection, so
    threads may share a repository and processes may share a database; the exception is an
    in-memory SQLite ledger (``sqlite://``), whose single connection must be used by one
    thread at a time.

    Parameters
    ----------
    engine : Engine
        An engine whose database is already at the head revision.
    url : str
        The normalized URL of that database.
    schema_upgrade : SchemaUpgrade or None
        The upgrade opening made to the ledger's schema, if any.
    """

    def __init__(
        self, engine: Engine, url: str, *, schema_upgrade: SchemaUpgrade | None = None
    ) -> None:
        self._engine = engine
        self._url = url
        self._read: sessionmaker[Session]
        self._write: sessionmaker[Session]
        self._read, self._write = make_session_factories(engine)
        self._closed = False
        # The one read transaction of a ``snapshot()``; None: each call has its own.
        self._snapshot: Session | None = None
        self.schema_upgrade = schema_upgrade

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> LedgerRepository:
        """Open (creating and migrating if needed) the ledger at ``url``.

        Only an empty database or a ledger of ours is opened: a database holding another
        application's tables is refused and left as it was, never migrated into a ledger.

        Parameters
        ----------
        url : str or None
            A SQLAlchemy URL; a relative SQLite path is taken from the current directory.
            ``None`` opens ``$FLPLATFORM_HOME/ledger.db``, creating the directory.
        create : bool
            False for readers (the history commands): a missing SQLite file or an empty
            database is refused, not created, and the home directory is not made.

        Returns
        -------
        LedgerRepository
            A repository over a database at the head revision; its ``schema_upgrade`` is the
            upgrade opening made, if any (a reader should say so: a flplatform older than
            this one refuses the ledger from then on).

        Raises
        ------
        StorageError
            If the URL is malformed or names an unknown or missing driver, the server is
            unreachable, the path is unwritable, the file is not a database, the database
            belongs to another application (or, with ``create=False``, holds no ledger), or
            the schema was written by a newer flplatform (or is older, and the URL may only
            read).
        """
        if url is None:
            if create:
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
        shown = mask_db_url(normalized)
        path = sqlite_file(normalized)
        new_file = path is not None and not path.exists()
        if new_file and not create:
            raise StorageError(
                f"no ledger at {path}: the file does not exist (flplatform simulate, run and "
                f"demo record runs there); {URL_HINT} to read another ledger"
            )
        engine = create_ledger_engine(normalized)
        try:
            if not new_file and not is_in_memory(normalized):  # nothing to look at in either
                _check_is_ledger(normalized, shown, create=create)
            schema_upgrade = upgrade_to_head(engine)
        except StorageError:
            engine.dispose()
            raise
        except (SQLAlchemyError, CommandError, OSError) as exc:
            engine.dispose()
            if _is_locked(exc):
                # Only after the busy timeout: another process is legitimately writing (or
                # wedged); a different --db would not help.
                raise StorageError(
                    f"cannot open database {shown!r}: it stayed locked by another process; "
                    "retry when that process has finished writing"
                ) from exc
            raise StorageError(
                f"cannot open database {shown!r}: {_why(exc, path)}; {URL_HINT}"
            ) from exc
        return cls(engine, normalized, schema_upgrade=schema_upgrade)

    def check_writable(self) -> None:
        """Raise ``StorageError`` now unless a run can be recorded here; writes nothing.

        Opening only reads a ledger already at the current schema, so a read-only file (or
        a role that may only read) would pass, and the ServerApp's first row would fail
        after Flower's whole start-up. A write that changes nothing, rolled back, meets the
        same refusal at once.
        """
        try:
            with self._engine.connect() as connection:
                writer = connection.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
                with writer.begin() as transaction:
                    writer.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = version_num"))
                    transaction.rollback()
        except SQLAlchemyError as exc:
            raise StorageError(
                f"cannot record runs in {self.url}: {_why(exc, sqlite_file(self._url))}; "
                f"make it writable or {URL_HINT}"
            ) from exc

    @property
    def url(self) -> str:
        """The normalized URL of the database, password masked (safe to print)."""
        return mask_db_url(self._url)

    @property
    def ledger_id(self) -> str:
        """A directory name for this ledger, without any secret (``session.ledger_id``)."""
        return ledger_id(self._url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    def close(self) -> None:
        """Release the connections; the repository cannot be used afterwards."""
        self._closed = True
        if self._snapshot is None:  # a snapshot's engine is its repository's
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
    def snapshot(self) -> Iterator[LedgerRepository]:
        """A repository whose reads all see the ledger as it was at one moment.

        Each call of this repository is a transaction of its own, so a reader that reads a
        run, then its rounds, then their updates while the run is being recorded could show
        a run row and rounds (or updates) from different moments. Every read through the
        snapshot is in one read transaction: on SQLite each sees the database as of the
        first; elsewhere the transaction is ``REPEATABLE READ``, which on PostgreSQL means
        the same. Writers go on meanwhile (SQLite in WAL mode, the ledger's; PostgreSQL),
        and the snapshot refuses writes. Use it in one thread, within the block.

        Yields
        ------
        LedgerRepository
            This repository's reads, in one transaction, rolled back when the block ends.
        """
        if self._closed:
            raise StorageError(f"cannot read a snapshot: the ledger {self.url} is closed")
        engine = self._engine
        if engine.dialect.name != "sqlite":  # SQLite's transactions are serializable already
            engine = engine.execution_options(isolation_level="REPEATABLE READ")
        session = sessionmaker(bind=engine, expire_on_commit=False)()
        view = copy.copy(self)
        view._snapshot = session
        try:
            yield view
        finally:
            view._closed = True
            session.close()  # rolls back: nothing was written

    @contextmanager
    def _session(self, action: str, *, write: bool = False) -> Iterator[Session]:
        """A committed-on-exit session whose database errors become ``StorageError``; in a
        snapshot, its one read transaction."""
        if self._closed:
            raise StorageError(f"cannot {action}: the ledger {self.url} is closed")
        try:
            if self._snapshot is None:
                with session_scope(self._write if write else self._read) as session:
                    yield session
            elif write:
                raise StorageError(f"cannot {action}: a snapshot of {self.url} only reads")
            else:
                yield self._snapshot
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

    def _require_run(self, session: Session, run_id: int, *, lock: bool = False) -> Run:
        """The run's row; ``lock``: locked until the transaction ends (PostgreSQL's
        ``FOR UPDATE``; SQLite's write transactions are serialized already)."""
        run = session.get(Run, run_id, with_for_update=lock)
        if run is None:
            raise self._missing_run(run_id)
        return run

    def _require_running(self, session: Session, run_id: int, action: str) -> Run:
        """The run's row, locked, if the run is still running.

        A finished or failed run takes no more rows: a ServerApp that outlives the command
        that stopped its run (or its SuperLink) stops at its next write, instead of
        writing rounds into a run already marked failed. The lock keeps a ``finish_run``
        of another process from landing between this check and the write.
        """
        run = self._require_run(session, run_id, lock=True)
        if run.status != RUN_RUNNING:
            why = f" ({run.error})" if run.error else ""
            raise StorageError(
                f"cannot {action}: run {run_id} is {run.status}{why}; a run takes no rows "
                "once it has finished or failed"
            )
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
        owner: str | None = None,
        event: tuple[str, dict[str, Any]] | None = None,
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
        owner : str or None
            ``"host:pid"`` of the process that records the run (a resume refuses a run whose
            owner is still alive).
        event : (str, dict) or None
            An event (kind, detail) recorded with the run, in the same transaction: no one
            ever sees the run without it (a deployed run's ``deployed`` event).

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
            tag=check_name("run tag", tag, max_length=NAME_LENGTH, optional=True),
            name=check_name("run name", name, max_length=NAME_LENGTH),
            strategy=check_name("strategy", strategy, max_length=STRATEGY_LENGTH),
            seed=check_signed64("seed", seed),
            config=check_json_object("run config", config),
            num_rounds_planned=check_count(
                "num_rounds_planned", num_rounds_planned, maximum=INT32_MAX
            ),
            status=RUN_RUNNING,
            created_at=to_datetime("created_at", time.time() if created_at is None else created_at),
            network=check_name("network", network, max_length=NAME_LENGTH, optional=True),
            owner=check_name("owner", owner, max_length=NAME_LENGTH, optional=True),
        )
        first = None
        if event is not None:
            kind, detail = event
            first = RunEvent(
                at=row.created_at,
                kind=check_name("event kind", kind, max_length=EVENT_KIND_LENGTH),
                detail=check_json_object("event detail", detail),
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
            if first is not None:
                first.run_id = row.id
                session.add(first)
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
            The running run to finish.
        status : {"finished", "failed"}
            How it ended.
        error : str or None
            Why it failed. A warning recorded while the run ran (``record_round``'s
            ``run_warning``) is kept: after ``error`` when it failed, alone when it finished.
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
        metrics = None if final_metrics is None else check_metrics("final_metrics", final_metrics)
        if error is not None and not isinstance(error, str):
            raise StorageError(f"error must be a string or None, got {type(error).__name__}")
        simulated = check_seconds("simulated_seconds", simulated_seconds)
        end = time.time() if finished_at is None else finished_at
        end_dt = to_datetime("finished_at", end)
        with self._session(f"finish run {run_id}", write=True) as session:
            run = self._require_run(session, run_id, lock=True)
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
            run.error = _joined(free_text(error), run.error)
            run.final_metrics = metrics
            run.finished_at = end_dt
            run.wall_seconds = wall
            run.simulated_seconds = simulated

    def reopen_run(self, run_id: int, owner: str) -> RunRecord:
        """Mark a run that died (``running``, or ``failed``) running again, owned by ``owner``.

        Its ``error``, ``finished_at``, wall and simulated times and final metrics are
        cleared, and a ``"resumed"`` event records what they were, in the same transaction.
        Whether the previous owner is still alive is the caller's question: this only
        records the answer.

        Parameters
        ----------
        run_id : int
            The run to resume.
        owner : str
            ``"host:pid"`` of the process that now records the run.

        Returns
        -------
        RunRecord
            The run as it now is.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If the run finished (a finished run is complete; nothing is left to resume) or
            ``owner`` is not a name.
        """
        run_id = self._run_id(run_id)
        owner = cast(str, check_name("owner", owner, max_length=NAME_LENGTH))
        with self._session(f"reopen run {run_id}", write=True) as session:
            run = self._require_run(session, run_id, lock=True)
            if run.status == RUN_FINISHED:
                raise StorageError(
                    f"run {run_id} finished; only a run that is running or failed can be resumed"
                )
            detail = {
                "status": run.status,
                "error": run.error,
                "previous_owner": run.owner,
                "owner": owner,
            }
            run.status = RUN_RUNNING
            run.error = None
            run.finished_at = None
            run.wall_seconds = None
            run.simulated_seconds = None
            run.final_metrics = None
            run.owner = owner
            session.add(RunEvent(run_id=run_id, at=_now(), kind=RESUMED_EVENT, detail=detail))
        return self.get_run(run_id)

    # ------------------------------------------------------------------ events
    def add_event(
        self,
        run_id: int,
        kind: str,
        detail: dict[str, Any] | None = None,
        *,
        at: float | None = None,
    ) -> int:
        """Record something that happened to a run (of any status) besides its rounds.

        Parameters
        ----------
        run_id : int
            The run.
        kind : str
            What happened, a short name (``"resumed"``, ...), at most 32 characters.
        detail : dict[str, Any] or None
            What the recorder says about it, as JSON data.
        at : float or None
            Unix time; ``None`` means now.

        Returns
        -------
        int
            The event's id.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If a value is invalid.
        """
        run_id = self._run_id(run_id)
        row = RunEvent(
            run_id=run_id,
            at=_now() if at is None else to_datetime("at", at),
            kind=check_name("event kind", kind, max_length=EVENT_KIND_LENGTH),
            detail=check_json_object("event detail", {} if detail is None else detail),
        )
        with self._session(f"add an event to run {run_id}", write=True) as session:
            self._require_run(session, run_id)
            session.add(row)
            session.flush()
            return row.id

    def list_events(self, run_id: int) -> list[RunEventRecord]:
        """Return a run's events in the order they were recorded.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        with self._session(f"list the events of run {run_id}") as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.id)
            )
            return [to_record(RunEventRecord, row) for row in rows]

    def get_run(self, run_id: int) -> RunRecord:
        """Return one run.

        Parameters
        ----------
        run_id : int
            The run's id.

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
            row = session.execute(runs_query().where(Run.id == run_id)).first()
            if row is None:
                raise self._missing_run(run_id)
            return run_record(*row)

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
        check_name("run tag", tag, max_length=NAME_LENGTH)
        with self._session(f"find the run tagged {tag!r}") as session:
            row = session.execute(runs_query().where(Run.tag == tag)).first()
            return None if row is None else run_record(*row)

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
        query = runs_query().order_by(Run.created_at.desc(), Run.id.desc())
        if limit is not None:
            query = query.limit(check_count("limit", limit))
        with self._session("list runs") as session:
            return [run_record(*row) for row in session.execute(query)]

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
        """Record a site taking part in a run; a site already in it rejoins.

        A site is known by its name within the run: adding a name the run already has (the
        same site, back after a resume with a new Flower node id) updates that site's node id
        and the facts given (partition, examples, profile) and returns its id.

        Parameters
        ----------
        run_id : int
            The run the site takes part in.
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
            If a value is invalid, or the run is no longer running.
        """
        run_id = self._run_id(run_id)
        row = Site(
            run_id=run_id,
            name=check_name("site name", name, max_length=NAME_LENGTH),
            node_id=check_count("node_id", node_id, maximum=UINT64_MAX),
            partition_id=None
            if partition_id is None
            else check_count("partition_id", partition_id, maximum=INT32_MAX),
            num_examples=None
            if num_examples is None
            else check_count("num_examples", num_examples),
            profile=check_json_object("site profile", {} if profile is None else profile),
        )
        taken = f"site {name!r} was added to run {run_id} by another process at the same time"
        with self._session(f"add site {name!r} to run {run_id}", write=True) as session:
            self._require_running(session, run_id, f"add site {name!r} to run {run_id}")
            existing = session.scalar(select(Site).where(Site.run_id == run_id, Site.name == name))
            if existing is not None:
                existing.node_id = row.node_id
                if partition_id is not None:
                    existing.partition_id = row.partition_id
                if num_examples is not None:
                    existing.num_examples = row.num_examples
                if profile is not None:
                    existing.profile = row.profile
                return existing.id
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
            The run whose sites to list.

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
            return [to_record(SiteRecord, site) for site in rows]

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
        run_warning: str | None = None,
        checkpoint: CheckpointInput | None = None,
    ) -> None:
        """Record one server step, every update and evaluation it handled, in one transaction.

        The round's ``bytes_up``, ``bytes_down`` and ``num_applied``/``num_dropped``/
        ``num_rejected`` are computed from ``updates``. Either the round and all its
        updates and evaluations are stored, or nothing is.

        Parameters
        ----------
        run_id : int
            The run the step belongs to.
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
        run_warning : str or None
            What this step revealed about the whole run (training diverged): added to the
            run's ``error`` in the same transaction, so a reader sees the round and the
            warning together; kept when the run finishes (see ``finish_run``).
        checkpoint : CheckpointInput or None
            The file holding the run's state after this step, already written: its row is
            committed with the round (a committed round with a checkpoint is resumable).

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If a value is invalid, the round is already recorded, an update or evaluation
            names a site the run does not have, two evaluations name the same site, or the
            run is no longer running (finished, or failed: stopped by the user, say).
        """
        # ---- check the step and its rows before touching the database
        run_id = self._run_id(run_id)
        step = check_count("round", round, maximum=INT32_MAX)
        if step < 1:
            raise StorageError("round must be >= 1 (server steps start at 1), got 0")
        start, end = check_wall_span(step, started_at, finished_at)
        virtual_start, virtual_end = check_virtual_span(
            step, virtual_started_at, virtual_finished_at
        )
        batch = check_rows("updates", updates, UpdateInput)
        evals = check_rows("evaluations", evaluations, EvaluationInput)
        check_one_evaluation_per_site(step, evals)
        check_total_bytes(step, "total evaluation bytes", evals)
        check_total_bytes(step, "total bytes", batch)
        row = Round(
            run_id=run_id,
            round=step,
            model_version=check_count("model_version", model_version, maximum=INT32_MAX),
            started_at=start,
            finished_at=end,
            wall_seconds=float(finished_at) - float(started_at),
            metrics=check_metrics("metrics", metrics),
            train_loss=finite_or_none("train_loss", train_loss),
            num_applied=sum(u.status == UPDATE_APPLIED for u in batch),
            num_dropped=sum(u.status == UPDATE_DROPPED for u in batch),
            num_rejected=sum(u.status == UPDATE_REJECTED for u in batch),
            bytes_up=sum(u.bytes_up for u in batch),
            bytes_down=sum(u.bytes_down for u in batch),
            virtual_started_at=virtual_start,
            virtual_finished_at=virtual_end,
        )
        # ---- write the round, then its rows, in one transaction
        if run_warning is not None and not isinstance(run_warning, str):
            raise StorageError(
                f"run_warning must be a string or None, got {type(run_warning).__name__}"
            )
        if checkpoint is not None and not isinstance(checkpoint, CheckpointInput):
            raise StorageError(
                f"checkpoint must be a CheckpointInput or None, got {type(checkpoint).__name__}"
            )
        with self._session(f"record round {step} of run {run_id}", write=True) as session:
            run = self._require_running(session, run_id, f"record round {step} of run {run_id}")
            if run_warning:
                run.error = _joined(run.error, free_text(run_warning))
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
            _insert_rows(session, Update, "update", batch, run_id, step, site_ids)
            _insert_rows(session, Evaluation, "evaluation", evals, run_id, step, site_ids)
            if checkpoint is not None:
                session.add(
                    Checkpoint(
                        run_id=run_id,
                        round=step,
                        model_version=row.model_version,
                        path=checkpoint.path,
                        size_bytes=checkpoint.size_bytes,
                        kept=checkpoint.kept,
                        created_at=_now(),
                    )
                )

    def list_rounds(self, run_id: int) -> list[RoundRecord]:
        """Return a run's rounds ordered by round number.

        Parameters
        ----------
        run_id : int
            The run whose rounds to list.

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
        with self._session(f"list the rounds of run {run_id}") as session:
            self._require_run(session, run_id)
            return [round_record(*row) for row in session.execute(rounds_query(run_id))]

    # ------------------------------------------------------------------ checkpoints
    def list_checkpoints(self, run_id: int) -> list[CheckpointRecord]:
        """Return a run's checkpoints ordered by round (empty for runs older than 0005).

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        with self._session(f"list the checkpoints of run {run_id}") as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.round)
            )
            return [to_record(CheckpointRecord, row) for row in rows]

    def latest_checkpoint(self, run_id: int) -> CheckpointRecord | None:
        """Return the checkpoint of a run's last checkpointed round (its resume point), or None.

        Raises
        ------
        NotFoundError
            If the run does not exist.
        """
        run_id = self._run_id(run_id)
        with self._session(f"read the latest checkpoint of run {run_id}") as session:
            self._require_run(session, run_id)
            row = session.scalar(
                select(Checkpoint)
                .where(Checkpoint.run_id == run_id)
                .order_by(Checkpoint.round.desc())
                .limit(1)
            )
            return None if row is None else to_record(CheckpointRecord, row)

    def keep_checkpoint(self, run_id: int, round: int) -> CheckpointRecord:
        """Mark the checkpoint of a round kept (retention leaves it); return it.

        Raises
        ------
        NotFoundError
            If the run does not exist or has no checkpoint for ``round``.
        """
        return self._change_checkpoint(run_id, round, keep=True)

    def delete_checkpoint(self, run_id: int, round: int) -> CheckpointRecord:
        """Delete the row of a round's checkpoint; return what it said (the file is the
        caller's to delete, after this commits, so no row ever names a deleted file).

        Raises
        ------
        NotFoundError
            If the run does not exist or has no checkpoint for ``round``.
        """
        return self._change_checkpoint(run_id, round, keep=None)

    def _change_checkpoint(self, run_id: int, round: int, *, keep: bool | None) -> CheckpointRecord:
        run_id = self._run_id(run_id)
        step = check_count("round", round, maximum=INT32_MAX)
        action = f"{'keep' if keep else 'delete'} the checkpoint of round {step} of run {run_id}"
        with self._session(action, write=True) as session:
            self._require_run(session, run_id)
            row = session.scalar(
                select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round == step)
            )
            if row is None:
                rounds = session.scalars(
                    select(Checkpoint.round)
                    .where(Checkpoint.run_id == run_id)
                    .order_by(Checkpoint.round)
                )
                raise NotFoundError(
                    f"run {run_id} has no checkpoint of round {step}; "
                    + checkpointed_rounds(run_id, list(rounds))
                )
            if keep is None:
                session.delete(row)
            else:
                row.kept = keep
            session.flush()
            return to_record(CheckpointRecord, row)

    # ------------------------------------------------------------------ updates, evaluations
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
            The run whose updates to list.
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
        where = []
        if status is not None:
            where.append(Update.__table__.c.status.in_(check_update_statuses(status)))
        return self._list_rows(Update, UpdateRecord, run_id, round=round, site=site, where=where)

    def list_evaluations(
        self, run_id: int, *, round: int | None = None, site: str | None = None
    ) -> list[EvaluationRecord]:
        """Return a run's federated evaluations ordered by round, then as recorded.

        The arguments filter and the errors are those of ``list_updates``, which has a status
        filter besides; each ``EvaluationRecord`` carries its site's name.
        """
        return self._list_rows(Evaluation, EvaluationRecord, run_id, round=round, site=site)

    def _list_rows(
        self,
        model: type[Base],
        record_type: type[Row],
        run_id: int,
        *,
        round: int | None,
        site: str | None,
        where: Sequence[ColumnElement[bool]] = (),
    ) -> list[Row]:
        """A run's update or evaluation rows, by round then as recorded, as records."""
        run_id = self._run_id(run_id)
        table = cast(Table, model.__table__)
        query = (
            select(table, Site.name.label("site"))
            .join(Site, Site.id == table.c.site_id)
            .where(table.c.run_id == run_id, *where)
            .order_by(table.c.round, table.c.id)
        )
        if round is not None:
            query = query.where(table.c.round == check_count("round", round, maximum=INT32_MAX))
        if site is not None:
            query = query.where(Site.name == site)
        with self._session(f"list the {table.name} of run {run_id}") as session:
            self._require_run(session, run_id)
            if site is not None:
                self._require_site(session, run_id, site)
            return [to_record(record_type, row._mapping) for row in session.execute(query)]

    # ------------------------------------------------------------------ traffic
    def add_traffic(
        self, run_id: int, traffic: Sequence[TrafficInput], *, round: int | None = None
    ) -> None:
        """Record bytes with sites that no update or evaluation row holds, in one transaction.

        Parameters
        ----------
        run_id : int
            The running run.
        traffic : Sequence[TrafficInput]
            One row per site and kind (site-information queries, late replies); each names
            a site added to the run.
        round : int or None
            The server step during which the bytes crossed (``>= 1``); ``None`` before the
            first step of the run's process (sites joining, or rejoining after a resume).

        Raises
        ------
        NotFoundError
            If the run does not exist.
        StorageError
            If a value is invalid, a row names a site the run does not have, or the run is
            no longer running.
        """
        run_id = self._run_id(run_id)
        step = None if round is None else check_count("round", round, maximum=INT32_MAX)
        if step == 0:
            raise StorageError("round must be >= 1 (server steps start at 1) or None, got 0")
        rows = check_rows("traffic", traffic, TrafficInput)
        check_total_bytes(step or 0, "total traffic bytes", rows)
        action = f"record traffic of run {run_id}"
        with self._session(action, write=True) as session:
            self._require_running(session, run_id, action)
            site_query = select(Site.name, Site.id).where(Site.run_id == run_id)
            site_ids = {name: site_id for name, site_id in session.execute(site_query)}
            _insert_rows(session, Traffic, "traffic", rows, run_id, step, site_ids)

    def list_traffic(
        self, run_id: int, *, site: str | None = None, kind: str | Iterable[str] | None = None
    ) -> list[TrafficRecord]:
        """Return a run's traffic rows in the order they were recorded.

        Parameters
        ----------
        run_id : int
            The run whose traffic to list.
        site : str or None
            Only this site's rows.
        kind : str, iterable of str, or None
            Only rows of this kind, or of any of these (``TRAFFIC_KINDS``).

        Raises
        ------
        NotFoundError
            If the run does not exist, or ``site`` is not one of its sites.
        StorageError
            If a kind is not one of ``TRAFFIC_KINDS``.
        """
        run_id = self._run_id(run_id)
        table = cast(Table, Traffic.__table__)
        query = (
            select(table, Site.name.label("site"))
            .join(Site, Site.id == table.c.site_id)
            .where(table.c.run_id == run_id)
            .order_by(table.c.id)
        )
        if kind is not None:
            query = query.where(table.c.kind.in_(check_traffic_kinds(kind)))
        if site is not None:
            query = query.where(Site.name == site)
        with self._session(f"list the traffic of run {run_id}") as session:
            self._require_run(session, run_id)
            if site is not None:
                self._require_site(session, run_id, site)
            return [to_record(TrafficRecord, row._mapping) for row in session.execute(query)]

    def site_summaries(self, run_id: int) -> list[SiteSummary]:
        """Return per-site totals over a run's updates, evaluations and traffic.

        Sites come in the order they were added, those with no updates or evaluations with zero
        counts; what each total covers is said in ``SiteSummary``, how it is computed in
        ``storage.summaries.site_summaries``.

        Parameters
        ----------
        run_id : int
            The run whose sites to summarise.

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
        with self._session(f"summarise the sites of run {run_id}") as session:
            self._require_run(session, run_id)
            return site_summaries(session, run_id)


def _insert_rows(
    session: Session,
    model: type[Base],
    noun: str,
    rows: Sequence[UpdateInput] | Sequence[EvaluationInput] | Sequence[TrafficInput],
    run_id: int,
    step: int | None,
    site_ids: dict[str, int],
) -> None:
    """Insert a step's update, evaluation or traffic rows, each naming a site the run has."""
    values = []
    where = "" if step is None else f"round {step}: "
    for row in rows:
        if row.site not in site_ids:
            known = ", ".join(sorted(site_ids)) or "none"
            raise StorageError(
                f"{where}{noun} from site {row.site!r}, which run {run_id} does not "
                f"have (its sites: {known}); add it with add_site first"
            )
        values.append(row_values(row, run_id=run_id, step=step, site_id=site_ids[row.site]))
    if values:
        session.execute(insert(model), values)


def _now() -> datetime:
    return datetime.now(UTC)


def checkpointed_rounds(run_id: int, rounds: Sequence[int]) -> str:
    """Which rounds of a run have a checkpoint, said for an error message."""
    if not rounds:
        return (
            f"run {run_id} has no checkpoints (it was recorded without them, or by a "
            "flplatform older than checkpoints)"
        )
    noun = "round" if len(rounds) == 1 else "rounds"
    return f"run {run_id} has checkpoints of {noun} {', '.join(map(str, rounds))}"


def _joined(first: str | None, then: str | None) -> str | None:
    """A run's ``error`` text from two parts, either of which may be missing.

    A failure's reason comes first, a warning noted while the run ran after it (training
    that diverged is often why a run then failed); a part already there is not repeated.
    """
    parts = [part for part in (first, then) if part]
    if len(parts) == 2 and parts[1] in parts[0]:
        return parts[0]
    return "; ".join(parts) or None
