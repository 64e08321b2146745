"""A migrated, empty SQLite ledger, made once and copied for each test that needs one; and
a SQLite ledger's write lock, held.

Opening a new file runs Alembic's migrations (~0.2 s on a busy machine); copying the file
they left takes a tenth of that. tests/conftest.py makes the template once per session
(``ledger_template``) and gives each test its own copy (``sqlite_ledger``, ``ledger``).
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from storage import LedgerRepository

TEMPLATE_NAME = "template.db"


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def make_template(directory: Path) -> Path:
    """A migrated, empty ledger at ``directory/template.db``, closed: the one file it needs."""
    path = directory / TEMPLATE_NAME
    with LedgerRepository.open(sqlite_url(path)):
        pass
    leftovers = sorted(p.name for p in directory.iterdir() if p != path)
    assert not leftovers, f"the template ledger left {leftovers} beside it"
    return path


def copy_ledger(template: Path, path: Path) -> str:
    """``template`` copied to ``path`` (a new file); its SQLite URL."""
    assert not path.exists(), path
    shutil.copyfile(template, path)
    return sqlite_url(path)


@contextmanager
def sqlite_write_lock(path: str, *, timeout: float = 5.0) -> Iterator[None]:
    """Hold the write lock of the SQLite file at ``path`` (``BEGIN IMMEDIATE``): no other
    connection commits meanwhile (each waits, within its busy timeout); readers read on."""
    connection = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        yield
        connection.execute("ROLLBACK")
    finally:
        connection.close()
