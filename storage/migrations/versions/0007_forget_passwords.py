"""Forget database passwords that older versions kept in runs' options.

Revision ID: 0007
Revises: 0006
Create Date: 2027-03-02

Before this revision a run's stored options (``runs.config``) held the ledger URL as the
user typed it, password included, and ``history runs`` printed it. The options now hold
the URL without its password (the password reaches the ServerApp in its environment).
This revision removes the password from the ``db`` option of every run recorded earlier;
nothing else changes. A password cannot be brought back, so the downgrade changes nothing.
Frozen: it parses URLs with SQLAlchemy itself, not with storage/session.py, which may change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_runs = sa.table("runs", sa.column("id", sa.Integer()), sa.column("config", sa.JSON()))


def without_password(url: str) -> str | None:
    """``url`` without its password (after the user name or as the query's ``password``);
    None when it holds none. A value that is no URL is replaced by a placeholder: it may be
    a password typed in the wrong place; an empty one (the default ledger) is kept."""
    if not url.strip():
        return None
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return "<not a database URL: removed>"
    if parsed.password is None and "password" not in parsed.query:
        return None
    parsed = parsed._replace(password=None).difference_update_query(["password"])
    return parsed.render_as_string(hide_password=False)


def upgrade() -> None:
    """Rewrite the ``db`` option of every run whose URL holds a password."""
    connection = op.get_bind()
    for run_id, config in connection.execute(sa.select(_runs.c.id, _runs.c.config)).all():
        if not isinstance(config, dict) or not isinstance(config.get("db"), str):
            continue
        cleaned = without_password(config["db"])
        if cleaned is not None:
            connection.execute(
                _runs.update().where(_runs.c.id == run_id).values(config={**config, "db": cleaned})
            )


def downgrade() -> None:
    """Nothing to undo: a forgotten password stays forgotten."""
