"""Database URLs, engines and the one session scope the repository writes through.

SQLite is the zero-set-up default (``$FLPLATFORM_HOME/ledger.db``); any SQLAlchemy URL works,
PostgreSQL (``postgresql+psycopg://``) being the tested one for shared deployments.

SQLite connections are tuned so that the ledger behaves like a server database:

* ``journal_mode=WAL`` lets the history CLI read while a run writes. Switching a new file to
  WAL is the one step ``busy_timeout`` does not cover (see ``_enable_wal``), so it is retried;
* ``busy_timeout`` makes a second writer (or a migration) wait for the first instead of
  failing at once with "database is locked";
* ``foreign_keys=ON`` so ``ON DELETE CASCADE`` and the foreign keys hold at all;
* transactions are begun by us (``BEGIN`` / ``BEGIN IMMEDIATE``) rather than by the ``sqlite3``
  module, which skips ``BEGIN`` before DDL and so would run migrations outside a transaction.
  Write sessions take the write lock up front (``IMMEDIATE``): a deferred transaction that read
  first could not upgrade to a writer once another process had committed in between.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool

from flplatform.core.errors import StorageError

FLPLATFORM_HOME_ENV: Final = "FLPLATFORM_HOME"
DEFAULT_HOME_DIRNAME: Final = ".flplatform"
LEDGER_FILENAME: Final = "ledger.db"

# Long enough to outlast any single ledger transaction of another process (they are short:
# one round with its updates), short enough that a wedged writer is reported, not waited on.
SQLITE_BUSY_TIMEOUT_MS: Final = 30_000
POSTGRES_CONNECT_TIMEOUT_S: Final = 10

# Backoff between attempts to switch a new file to WAL (see ``_enable_wal``): from the first
# delay, doubling up to the cap, jittered, until SQLITE_BUSY_TIMEOUT_MS is spent.
_WAL_RETRY_FIRST_DELAY_S: Final = 0.002
_WAL_RETRY_MAX_DELAY_S: Final = 0.1
_SQLITE_BUSY: Final = 5  # SQLITE_BUSY; the low byte of its extended codes (BUSY_SNAPSHOT, ...)

# What a SQLite URL's query may hold: pysqlite's own arguments, which SQLAlchemy passes to
# sqlite3.connect(), and SQLite's URI parameters (https://sqlite.org/uri.html), which SQLite
# reads from a "file:" name opened with uri=True.
_PYSQLITE_ARGUMENTS: Final = frozenset(
    {"uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements"}
)
_SQLITE_URI_PARAMETERS: Final = frozenset(
    {"mode", "immutable", "nolock", "cache", "psow", "vfs", "modeof"}
)

# Execution option read by the SQLite "begin" hook: "DEFERRED" (reads) or "IMMEDIATE" (writes).
SQLITE_BEGIN_OPTION: Final = "flplatform_sqlite_begin"

URL_HINT: Final = "pass --db with a SQLAlchemy URL such as sqlite:///runs.db"

# libpq (psycopg's client library) takes the password a PostgreSQL URL leaves out from this
# variable, else from the password file (~/.pgpass, or the file $PGPASSFILE names).
PASSWORD_ENV: Final = "PGPASSWORD"
PASSWORD_FILE_ENV: Final = "PGPASSFILE"
# libpq's keyword for the password, which psycopg also takes from a URL's query string.
_QUERY_PASSWORD: Final = "password"
# The password of text shaped like ``scheme://user:password@host`` that is no URL: all up to
# the last "@" (a password may hold "/" or "@"; masking some of the host is harmless).
_UNPARSED_PASSWORD: Final = re.compile(r"(//[^/@:]*):.*@")
# ... and a query's password in such text
_UNPARSED_QUERY_PASSWORD: Final = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def flplatform_home() -> Path:
    """Return the platform's home directory (not created).

    Returns
    -------
    Path
        Absolute ``$FLPLATFORM_HOME``, or ``<cwd>/.flplatform`` when it is unset or empty.
    """
    configured = os.environ.get(FLPLATFORM_HOME_ENV, "").strip()
    home = Path(configured).expanduser() if configured else Path(DEFAULT_HOME_DIRNAME)
    return Path(os.path.abspath(home))


def default_db_url() -> str:
    """Return the URL of the default ledger, ``sqlite:///<abs>/ledger.db`` in the home dir.

    Returns
    -------
    str
        A ``sqlite:///`` URL with an absolute path; the directory is created by
        ``LedgerRepository.open``, not here.
    """
    path = str(flplatform_home() / LEDGER_FILENAME)
    # URL.create escapes what a raw f-string would not ("%", ":", "?" in the path).
    return URL.create("sqlite", database=path).render_as_string(hide_password=False)


def _parse(url: str) -> URL:
    """Parse ``url`` or raise ``StorageError`` saying what a valid one looks like."""
    if not isinstance(url, str) or not url.strip():
        raise StorageError(f"empty database URL {url!r}; {URL_HINT}, or leave it unset")
    try:
        return make_url(url.strip())
    except (ArgumentError, ValueError) as exc:
        raise StorageError(
            f"cannot parse database URL {mask_db_url(url)!r} ({exc}); {URL_HINT}"
        ) from None


def _is_sqlite_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def is_in_memory(url: str) -> bool:
    """Whether ``url`` names an in-memory SQLite database (new and empty when opened)."""
    return _is_sqlite_memory(_parse(url))


def _is_sqlite_file_uri(url: URL) -> bool:
    database = url.database or ""
    return str(url.query.get("uri", "")).lower() == "true" or database.startswith("file:")


def normalize_db_url(url: str) -> str:
    """Return ``url`` with a relative SQLite path made absolute against the current directory.

    Another process (the history CLI, a SuperLink) started from another directory then opens
    the same file. In-memory and ``file:`` URI databases and non-SQLite URLs are returned as
    parsed; ``~`` in a SQLite path is expanded.

    Parameters
    ----------
    url : str
        A SQLAlchemy URL.

    Returns
    -------
    str
        The normalized URL, password included (use ``mask_db_url`` for display).

    Raises
    ------
    StorageError
        If ``url`` is empty or cannot be parsed.
    """
    parsed = _parse(url)
    if (
        parsed.get_backend_name() != "sqlite"
        or _is_sqlite_memory(parsed)
        or _is_sqlite_file_uri(parsed)
    ):
        # Returned as given: re-rendering would percent-encode, e.g. ":memory:" as "%3Amemory%3A".
        return url.strip()
    path = _absolute(parsed.database or "")
    return parsed.set(database=path).render_as_string(hide_password=False)


def _absolute(path: str) -> str:
    """``path`` (``~`` expanded) made absolute against the current directory, naming the file
    the operating system opens: a ``..`` after a symbolic link leads from the link's target,
    so a path holding one has its directory resolved rather than shortened as text
    (``abspath``, which SQLAlchemy's SQLite driver applies too, would name another file)."""
    expanded = os.path.expanduser(path)
    if ".." not in Path(expanded).parts:
        return os.path.abspath(expanded)
    directory, name = os.path.split(expanded)
    return os.path.join(os.path.realpath(directory or "."), name)


def mask_db_url(url: str) -> str:
    """Return ``url`` with its password replaced by ``***``, for messages and ``repr``.

    Parameters
    ----------
    url : str
        A SQLAlchemy URL.

    Returns
    -------
    str
        The URL safe to print: the password masked wherever the URL holds one (after the
        user name, or as the query's ``password``), also in text too malformed to parse that
        looks like ``scheme://user:password@host``. A URL without a password is returned as
        is, except a SQLite file's path, shown as the user wrote it (the normalized URL
        percent-encodes its brackets, spaces and colons).
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        masked = _UNPARSED_PASSWORD.sub(r"\1:***@", url)
        return _UNPARSED_QUERY_PASSWORD.sub(r"\1***", masked)
    if _QUERY_PASSWORD in parsed.query:
        parsed = parsed.update_query_dict({_QUERY_PASSWORD: "***"})
    if parsed.password is not None or _QUERY_PASSWORD in parsed.query:
        return parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not parsed.query:
        return f"{parsed.drivername}:///{parsed.database}"
    return url


def split_password(url: str) -> tuple[str, str | None]:
    """Return ``url`` without its password, and the password (None when it holds none).

    The URL without the password is the one that may be stored, printed or handed to
    another process: it still names the database and who logs in, and PostgreSQL's client
    finds the password in ``PGPASSWORD`` or ``~/.pgpass`` (see :func:`detach_password`).

    Parameters
    ----------
    url : str
        A SQLAlchemy URL; the password may follow the user name or be the query's
        ``password``.

    Returns
    -------
    tuple[str, str or None]
        The URL (as given when it holds no password) and the password.

    Raises
    ------
    StorageError
        If ``url`` is empty or cannot be parsed.
    """
    parsed = _parse(url)
    query_password = parsed.query.get(_QUERY_PASSWORD)
    if parsed.password is None and query_password is None:
        return url.strip(), None
    password = parsed.password if parsed.password is not None else query_password
    if isinstance(password, tuple):  # the key repeated: psycopg takes the last
        password = password[-1]
    # Not ``set(password=None)``: ``URL.set`` leaves a field it is given None for unchanged.
    public = parsed._replace(password=None).difference_update_query([_QUERY_PASSWORD])
    return public.render_as_string(hide_password=False), str(password)


def detach_password(url: str) -> tuple[str, dict[str, str]]:
    """Split ``url`` for another process: the URL to give it, and the environment to add.

    The URL holds no password (``split_password``): a run config, a log or the ledger may
    keep it. The password, from the URL or else from this process's ``PGPASSWORD``, goes
    into a password file only this process holds (:func:`password_file`), named by
    ``PGPASSFILE``, where libpq reads it when it connects: no process's environment or
    command line holds it, and it is on no disk. A URL without one, and no ``PGPASSWORD``,
    leaves the process to find it as the user's own processes do (``~/.pgpass``, the file
    ``PGPASSFILE`` names). The file lasts as long as this process, which must outlive the
    processes that connect (the command that starts a run follows it to its end). Where
    there is no such file (not Linux), the password goes into the environment
    (``PGPASSWORD``): there, ``~/.pgpass`` keeps it out of every environment.

    Parameters
    ----------
    url : str
        A SQLAlchemy URL; ``""`` (the default ledger) is returned as is.

    Returns
    -------
    tuple[str, dict[str, str]]
        The URL without a password, and ``{"PGPASSFILE": path}`` (not Linux:
        ``{"PGPASSWORD": password}``) or ``{}``.

    Raises
    ------
    StorageError
        If ``url`` cannot be parsed, or holds the password of a database other than
        PostgreSQL (only libpq reads one from a password file).
    """
    if not url:
        return url, {}
    public, password = split_password(url)
    backend = make_url(public).get_backend_name()
    if password is None:
        password = os.environ.get(PASSWORD_ENV) if backend == "postgresql" else None
        if not password:
            return public, {}
    if backend != "postgresql":
        raise StorageError(
            f"cannot hand the password in {mask_db_url(url)!r} to the run's processes: only "
            "a PostgreSQL password travels (in a password file), never in a URL that is "
            f"stored; use a {backend} URL without a password"
        )
    path = password_file(public, password)
    if path is None:  # not Linux: in the environment, as libpq also reads it
        return public, {PASSWORD_ENV: password}
    return public, {PASSWORD_FILE_ENV: path}


# The password files this process made: open until it ends (see ``password_file``).
_PASSWORD_FILES: dict[str, int] = {}


def password_file(url: str, password: str) -> str | None:
    """A PostgreSQL password file (``~/.pgpass``'s format) giving ``password`` for the
    database of ``url``; its path, for ``PGPASSFILE``.

    The file is in memory (``memfd_create``): on no disk, gone when this process ends,
    readable through ``/proc/<this pid>/fd/<n>`` by this user's processes (owner-only,
    as libpq requires), as ``~/.pgpass`` is. One file per URL and password. None on a
    system without ``memfd_create`` (not Linux).

    Raises
    ------
    StorageError
        If the password holds a line break, which the file's format cannot.
    """
    if "\n" in password or "\r" in password:
        raise StorageError(
            "a PostgreSQL password with a line break cannot be handed to the run's "
            "processes (libpq's password file is one line per entry)"
        )
    parsed = make_url(url)

    def field(value: object) -> str:
        return "*" if value in (None, "") else str(value).replace("\\", "\\\\").replace(":", "\\:")

    line = ":".join(
        field(v) for v in (parsed.host, parsed.port, parsed.database, parsed.username, password)
    )
    if line in _PASSWORD_FILES:
        return f"/proc/{os.getpid()}/fd/{_PASSWORD_FILES[line]}"
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    fd = create("flplatform-pgpass", os.MFD_CLOEXEC)  # not inherited: opened by path
    os.fchmod(fd, 0o600)
    os.write(fd, (line + "\n").encode())
    _PASSWORD_FILES[line] = fd
    return f"/proc/{os.getpid()}/fd/{fd}"


def ledger_id(url: str) -> str:
    """A directory name for the ledger at ``url``: the same in every process, no secret in it.

    It names where the ledger's data is (backend, host, port, database), never who reads it:
    the password and the user are left out, so the name is safe on disk and two users of one
    PostgreSQL database share their runs' checkpoints. A readable prefix (the SQLite file's
    name, or the database's) is followed by a hash of the location, so two ledgers never
    share a directory. A SQLite file is named by its real path (symbolic links resolved, also
    where the file does not exist yet), so that one file reached through a link, or through a
    linked directory, is one ledger: its runs' checkpoints in one directory, its runs
    exported once. A path without links keeps the id it always had.

    Parameters
    ----------
    url : str
        A URL as returned by ``normalize_db_url``.

    Returns
    -------
    str
        ``"<backend>-<name>-<12 hex digits>"`` of the characters ``[A-Za-z0-9._-]``.
    """
    parsed = _parse(url)
    backend = parsed.get_backend_name()
    database = parsed.database or ""
    if backend == "sqlite" and not (_is_sqlite_memory(parsed) or _is_sqlite_file_uri(parsed)):
        # The file as SQLite reaches it; a file not created yet gets its directories' links
        # resolved (realpath does not require it to exist), so its id holds once it is made.
        database = os.path.realpath(database)
    location = "\x00".join((backend, parsed.host or "", str(parsed.port or ""), database))
    digest = hashlib.sha256(location.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    name = Path(database).stem if backend == "sqlite" else database
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:40] or "memory"
    return f"{backend}-{readable}-{digest}"


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names; None for other backends, in-memory and ``file:`` URIs.

    Parameters
    ----------
    url : str
        A URL as returned by ``normalize_db_url``.

    Returns
    -------
    Path or None
        The database file (which may not exist yet).
    """
    parsed = _parse(url)
    if (
        parsed.get_backend_name() != "sqlite"
        or _is_sqlite_memory(parsed)
        or _is_sqlite_file_uri(parsed)
    ):
        return None
    return Path(parsed.database or "")


def _check_sqlite_path(url: URL, shown: str) -> None:
    """Refuse a SQLite path whose directory is missing or unwritable, before SQLite does.

    SQLite would only say "unable to open database file"; naming the directory tells the
    user what to fix. The directory of a user-given URL is never created: a typo in ``--db``
    should not silently start a new, empty ledger somewhere else.
    """
    if _is_sqlite_memory(url) or _is_sqlite_file_uri(url):
        return
    path = Path(url.database or "")
    if path.is_dir():
        raise StorageError(f"cannot open database {shown!r}: {path} is a directory; {URL_HINT}")
    parent = path.parent
    if not parent.is_dir():
        raise StorageError(
            f"cannot open database {shown!r}: directory {parent} does not exist; "
            f"create it first or {URL_HINT}"
        )
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise StorageError(
            f"cannot open database {shown!r}: directory {parent} is not writable; {URL_HINT}"
        )


def _with_sqlite_uri(url: URL, shown: str) -> URL:
    """``url`` with its SQLite URI parameters (``?mode=ro``) made to reach SQLite.

    SQLAlchemy hands them to SQLite only when the URL also says ``uri=true`` and its path is
    a ``file:`` name. Otherwise it warns that it ignores them (a raw ``SAWarning`` on the
    user's terminal) and opens the file read-write after all, or, given ``uri=true`` with a
    plain path, creates an empty file named "ledger.db?mode=ro" beside the ledger. A user who
    wrote ``sqlite:///ledger.db?mode=ro`` (or whose shell cut the URL at its unquoted ``&``)
    meant that file, read-only: the URL is made the ``file:`` URI that says so. A query key
    neither SQLite nor pysqlite knows (a typo, ``?mdoe=ro``) is refused, as SQLite would
    silently ignore it too.
    """
    keys = set(url.query) - _PYSQLITE_ARGUMENTS
    unknown = keys - _SQLITE_URI_PARAMETERS
    if unknown:
        raise StorageError(
            f"cannot open database {shown!r}: SQLite takes no parameter "
            f"{', '.join(repr(k) for k in sorted(unknown))}; its URLs take "
            f"{', '.join(sorted(_SQLITE_URI_PARAMETERS))} (e.g. sqlite:///ledger.db?mode=ro) "
            f"and {', '.join(sorted(_PYSQLITE_ARGUMENTS))}"
        )
    if not keys or _is_sqlite_memory(url):
        return url
    database = url.database or ""
    if not database.startswith("file:"):
        # SQLite decodes %HH in a URI's path; "?", "#" and "%" in a file name must be escaped.
        database = "file:" + quote(_absolute(database), safe="/")
    return url.set(database=database).update_query_dict({"uri": "true"})


def _is_read_only_sqlite(url: URL) -> bool:
    """Whether a SQLite URL opens its file for reading only (``mode=ro``, ``immutable=1``)."""
    immutable = str(url.query.get("immutable", "0")).lower() not in ("0", "false", "no", "off")
    return str(url.query.get("mode", "")).lower() == "ro" or immutable


def _is_busy(exc: BaseException) -> bool:
    """Whether a driver error is SQLITE_BUSY ("database is locked"), extended codes included."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == _SQLITE_BUSY
    return "database is locked" in str(exc).lower()


def _enable_wal(cursor: Any, operational_error: type[BaseException]) -> None:
    """Run ``PRAGMA journal_mode = WAL``, retrying while another connection holds a lock.

    On a file already in WAL mode the pragma only reads the header, and waits for locks
    through ``busy_timeout`` like any read. On a new (or rollback-journal) file it reads the
    header under a shared lock and then upgrades to an exclusive lock to rewrite it, and
    SQLite never calls the busy handler for that upgrade (two connections each holding a
    shared lock and waiting for the other would deadlock). So while another connection holds
    a lock on the file -- typically another process switching the same brand-new ledger to
    WAL at the same moment -- the pragma fails with "database is locked" at once, 30 s of
    busy timeout notwithstanding. The switch cannot run inside ``BEGIN IMMEDIATE`` either
    (SQLite refuses to change into WAL within a transaction), so it is retried here with
    jittered exponential backoff until ``SQLITE_BUSY_TIMEOUT_MS`` is spent, then the last
    error is raised. A failed attempt changes nothing; the winner's switch makes every later
    attempt the read-only case.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = _WAL_RETRY_FIRST_DELAY_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except operational_error as exc:
            remaining = deadline - time.monotonic()
            if not _is_busy(exc) or remaining <= 0:
                raise
        time.sleep(min(remaining, delay * random.uniform(0.5, 1.5)))
        delay = min(delay * 2, _WAL_RETRY_MAX_DELAY_S)


def _install_sqlite_hooks(engine: Engine, *, wal: bool) -> None:
    """Set the pragmas and the explicit ``BEGIN`` described in the module docstring."""
    operational_error: type[BaseException] = engine.dialect.loaded_dbapi.OperationalError

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if wal:
                _enable_wal(cursor, operational_error)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")


def create_ledger_engine(url: str, *, wal: bool = True) -> Engine:
    """Create an engine for a normalized ledger URL, with the per-backend settings.

    No connection is made here; connection errors surface on first use.

    Parameters
    ----------
    url : str
        A URL as returned by ``normalize_db_url``.
    wal : bool
        Switch a SQLite file to WAL on connecting (see the module docstring). False for a
        look at a database that may not be ours: the switch rewrites the file's header.

    Returns
    -------
    Engine
        The engine; SQLite engines carry the hooks described in the module docstring.

    Raises
    ------
    StorageError
        If the URL names an unknown dialect or a driver that is not installed, or a SQLite
        file in a missing or unwritable directory.
    """
    parsed = _parse(url)
    shown = mask_db_url(url.strip())  # the password hidden also where the query holds it
    backend = parsed.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "sqlite":
        _check_sqlite_path(parsed, shown)
        if parsed.get_driver_name() == "pysqlite":
            parsed = _with_sqlite_uri(parsed, shown)
        if _is_sqlite_memory(parsed):
            # Every connection to :memory: is a new, empty database: share one connection.
            kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    elif backend == "postgresql" and "connect_timeout" not in parsed.query:
        # libpq waits forever on an unroutable host by default; fail with a message instead.
        kwargs["connect_args"] = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S}
    try:
        engine = create_engine(parsed, **kwargs)
    except NoSuchModuleError:
        raise StorageError(
            f"cannot open database {shown!r}: unknown database driver {parsed.drivername!r}; "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        ) from None
    except ImportError as exc:
        raise StorageError(
            f"cannot open database {shown!r}: its driver module {exc.name or exc!s} is not "
            "installed; for PostgreSQL install flplatform[postgres] and use "
            "postgresql+psycopg://USER@HOST/DB"
        ) from None
    except (ArgumentError, TypeError, ValueError) as exc:
        raise StorageError(f"cannot open database {shown!r}: {exc}; {URL_HINT}") from None
    if backend == "sqlite":
        # A connection that may only read cannot switch a file to WAL (nor should it); it
        # reads a file in either journal mode.
        wal = wal and not (_is_sqlite_memory(parsed) or _is_read_only_sqlite(parsed))
        _install_sqlite_hooks(engine, wal=wal)
    return engine


def make_session_factories(engine: Engine) -> tuple[sessionmaker[Session], sessionmaker[Session]]:
    """Return ``(read, write)`` session factories for ``engine``.

    Parameters
    ----------
    engine : Engine
        An engine from ``create_ledger_engine``.

    Returns
    -------
    tuple[sessionmaker[Session], sessionmaker[Session]]
        Both keep loaded attributes after commit (records are built after the commit); the
        write factory begins SQLite transactions with ``BEGIN IMMEDIATE``.
    """
    writer = engine.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
    read = sessionmaker(bind=engine, expire_on_commit=False)
    write = sessionmaker(bind=writer, expire_on_commit=False)
    return read, write


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """Yield a session that commits when the block ends and rolls back if it raises.

    Parameters
    ----------
    factory : sessionmaker[Session]
        Where to get the session from.

    Yields
    ------
    Session
        A session in a fresh transaction; closed on exit.
    """
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        # A rollback that fails must not hide why the block ended: a Ctrl-C that lands
        # inside commit() leaves the session "committed", where rollback() raises, and
        # the CLI then said "cannot find the run ..." instead of stopping the run.
        with suppress(SQLAlchemyError):
            session.rollback()
        raise
    finally:
        session.close()
