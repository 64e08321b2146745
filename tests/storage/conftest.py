"""Fixtures running the ledger contract on every backend: a SQLite file and PostgreSQL.

The PostgreSQL server and its fresh databases come from ``tests/postgres.py`` (a server the
CI provides, or a throwaway cluster started for the session; see there). Each test gets a
fresh database or an emptied ledger, so tests never see each other's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from storage import LedgerRepository
from tests.postgres import create_database, drop_database

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def postgres_ledger(postgres_server: str) -> Iterator[str]:
    """URL of one migrated PostgreSQL ledger that the ``repo`` fixture empties per test.

    Creating a database costs ~0.1-0.2 s; emptying the tables costs milliseconds. Tests that
    need a database no migration has touched use ``ledger_url`` instead.
    """
    url = create_database(postgres_server)
    LedgerRepository.open(url).close()
    try:
        yield url
    finally:
        drop_database(postgres_server, url)


@pytest.fixture(params=BACKENDS)
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an empty database (no ledger tables yet) on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("postgres_database"))


@pytest.fixture(params=BACKENDS)
def new_ledger_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A factory of URLs of distinct empty databases on each backend (all dropped after)."""
    created: list[str] = []

    def new_url() -> str:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / f'ledger-{len(created)}.db'}"
        else:
            url = create_database(str(request.getfixturevalue("postgres_server")))
        created.append(url)
        return url

    yield new_url
    if request.param != "sqlite":
        for url in created:
            drop_database(str(request.getfixturevalue("postgres_server")), url)


@pytest.fixture(params=BACKENDS)
def repo(request: pytest.FixtureRequest) -> Iterator[LedgerRepository]:
    """An open repository over an empty, migrated ledger on each backend (SQLite: a copy of
    the session's template, tests/conftest.py's ``sqlite_ledger``)."""
    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_ledger"))
    else:
        url = str(request.getfixturevalue("postgres_ledger"))
    with LedgerRepository.open(url) as repository:
        if request.param != "sqlite":
            with repository._engine.begin() as connection:
                connection.execute(
                    text(
                        "TRUNCATE runs, sites, rounds, updates, evaluations, checkpoints, "
                        "run_events, traffic RESTART IDENTITY CASCADE"
                    )
                )
        yield repository
