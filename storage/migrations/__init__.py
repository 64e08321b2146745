"""Alembic migrations of the ledger, run programmatically whenever the ledger is opened.

The scripts live next to this module (``env.py``, ``versions/``) and are found through
``__file__``, so an installed wheel migrates exactly like a checkout. Opening is safe to repeat
and to race: a database already at head is left untouched without taking any lock, and an
upgrade runs in one transaction under a lock (``BEGIN IMMEDIATE`` on SQLite, an advisory
transaction lock on PostgreSQL), so a second process opening a new database at the same moment
waits, then finds it migrated. (On SQLite, connecting switches a new file to WAL first; that
switch is retried by ``storage.session`` since SQLite's busy timeout does not cover it.)
An upgrade of an existing ledger is reported (``SchemaUpgrade``): a flplatform older than the
new revision refuses the ledger from then on, which whoever shares it should hear about.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from flplatform.core.errors import StorageError

from ..session import SQLITE_BEGIN_OPTION

MIGRATIONS_DIR: Final = Path(__file__).resolve().parent

# Not the default "alembic_version": a PostgreSQL database shared with another Alembic-managed
# application must not mistake that application's revision for ours.
VERSION_TABLE: Final = "flplatform_alembic_version"

# pg_advisory_xact_lock key: any constant no other application is likely to use ("FLPL").
_POSTGRES_LOCK_KEY: Final = 0x464C504C


@dataclass(frozen=True)
class SchemaUpgrade:
    """A ledger's schema brought from an older revision (``old``) to this code's (``new``).

    After it, a flplatform that only knows ``old`` refuses the ledger ("revision ..., which
    this flplatform does not know").
    """

    old: str
    new: str


def alembic_config(connection: Connection | None = None) -> Config:
    """Return an Alembic ``Config`` for the ledger's scripts, without an ini file.

    Parameters
    ----------
    connection : Connection or None
        A connection ``env.py`` migrates through (so the caller owns the transaction and
        the SQLite pragmas apply); ``None`` for commands that only read the scripts.

    Returns
    -------
    Config
        The configuration with ``script_location`` inside this package.
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Split version_locations on os.pathsep, so an install path with spaces stays one path.
    config.set_main_option("path_separator", "os")
    config.set_main_option("version_locations", str(MIGRATIONS_DIR / "versions"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """Return the revision the current code expects the ledger to be at.

    Returns
    -------
    str
        The single head of the ledger's migration history.
    """
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001_initial
        raise StorageError(f"no ledger migrations found in {MIGRATIONS_DIR}; reinstall flplatform")
    return head


def current_revisions(connection: Connection) -> set[str]:
    """Return the revisions the database at ``connection`` is stamped with (empty if new).

    Parameters
    ----------
    connection : Connection
        An open connection to the ledger database.

    Returns
    -------
    set[str]
        Revision ids from the version table.
    """
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return set(context.get_current_heads())


def schema_objects(engine: Engine) -> tuple[str, ...]:
    """Return the names of the tables and views in the database at ``engine``, sorted.

    A database holding ``VERSION_TABLE`` is a ledger (possibly an old one); one holding
    nothing may become one; anything else belongs to another application.

    Parameters
    ----------
    engine : Engine
        An engine that changes nothing on connecting (``create_ledger_engine(url, wal=False)``).

    Returns
    -------
    tuple[str, ...]
        Names in the backend's default schema (SQLite's own ``sqlite_*`` tables excluded).
    """
    with engine.connect() as connection:
        inspector = inspect(connection)
        return tuple(sorted({*inspector.get_table_names(), *inspector.get_view_names()}))


def _upgrade_locked(engine: Engine) -> set[str]:
    """Upgrade to head in one transaction holding the backend's migration lock; return the
    revisions found under the lock (another process may have upgraded in the meantime)."""
    with engine.connect() as connection:
        connection = connection.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
        with connection.begin():
            if engine.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _POSTGRES_LOCK_KEY}
                )
            found = current_revisions(connection)
            # env.py sees the open transaction and runs inside it; the lock is held until
            # this block commits, so a waiting process then reads the final version table.
            command.upgrade(alembic_config(connection), "head")
    return found


def _is_read_only(exc: DBAPIError) -> bool:
    """Whether a driver error refused a write to a database opened for reading only (SQLite's
    ``mode=ro`` or a read-only file, PostgreSQL's read-only transaction or standby)."""
    message = str(exc.orig).lower()
    return "readonly" in message or "read-only" in message


def upgrade_to_head(engine: Engine) -> SchemaUpgrade | None:
    """Bring the ledger schema at ``engine`` to the head revision; a no-op when it is there.

    Parameters
    ----------
    engine : Engine
        An engine from ``storage.session.create_ledger_engine``.

    Returns
    -------
    SchemaUpgrade or None
        The upgrade made to an existing ledger; None when the schema was at head already
        (or another process upgraded it first), or the database was empty (a new ledger is
        created, not upgraded).

    Raises
    ------
    StorageError
        If the database carries a revision this code does not know (written by a newer
        flplatform), or an older one that a connection that may only read cannot upgrade.
    sqlalchemy.exc.SQLAlchemyError
        If the database cannot be reached or changed; the repository adds the URL and turns
        it into a ``StorageError``.
    """
    script = ScriptDirectory.from_config(alembic_config())
    head = script.get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001_initial
        raise StorageError(f"no ledger migrations found in {MIGRATIONS_DIR}; reinstall flplatform")
    with engine.connect() as connection:
        current = current_revisions(connection)
    if current == {head}:
        return None
    known = {revision.revision for revision in script.walk_revisions()}
    unknown = current - known
    if unknown:
        raise StorageError(
            f"the ledger schema is at revision {', '.join(sorted(unknown))}, which this "
            f"flplatform does not know (its newest is {head}); upgrade flplatform or use "
            "another database"
        )
    try:
        found = _upgrade_locked(engine)
    except DBAPIError as exc:
        if current and _is_read_only(exc):
            raise StorageError(
                f"the ledger schema is at revision {', '.join(sorted(current))}, older than "
                f"this flplatform's {head}, and this connection may only read, so it cannot "
                "be upgraded; open it once with write access (which upgrades it; older "
                "flplatform releases then refuse it) or read it with the flplatform that "
                "wrote it"
            ) from exc
        # Backends without a lock we know of (or a lock that failed) can still race; the loser
        # sees the winner's tables, and once the winner commits a retry finds head and stops.
        if "already exists" not in str(exc.orig).lower():
            raise
        found = _upgrade_locked(engine)
    if not found or found == {head}:
        return None
    return SchemaUpgrade(old=", ".join(sorted(found)), new=head)
