"""Alembic environment of the ledger.

The platform runs migrations through ``storage.migrations.upgrade_to_head``, which passes an
open connection in ``config.attributes["connection"]`` and owns its transaction. The
``alembic`` command line (see ``alembic.ini``) has no connection, so one is opened from
``-x db=URL`` or the default ledger.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from storage.migrations import VERSION_TABLE
from storage.models import metadata
from storage.session import create_ledger_engine, default_db_url, normalize_db_url

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit the migration SQL for ``alembic upgrade --sql`` without connecting."""
    context.configure(
        url=normalize_db_url(
            context.get_x_argument(as_dictionary=True).get("db", default_db_url())
        ),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate through the caller's connection, or one opened for the command line."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    if config.config_file_name is not None:
        fileConfig(config.config_file_name)
    url = context.get_x_argument(as_dictionary=True).get("db", default_db_url())
    engine = create_ledger_engine(normalize_db_url(url))
    try:
        with engine.connect() as own_connection:
            _run(own_connection)
            own_connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
