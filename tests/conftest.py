"""Shared fixtures: Flower's task identity for tests that build messages, isolated homes,
migrated empty SQLite ledgers copied from one template (``tests/helpers/ledgers.py``), and a
PostgreSQL server with fresh databases (``tests/postgres.py``).

Code the tests share other than fixtures is in tests/helpers/.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from storage import LedgerRepository
from tests.helpers.ledgers import copy_ledger, make_template

# Any test may take `postgres_database` or `password_database`.
pytest_plugins = ["tests.postgres"]

# Flower and Ray must never write to ~/.flwr or phone home from the test suite.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# One Ray actor per simulation: the suite runs more simulations at once than there are
# cores, so a second actor (one more process importing torch, about 5 CPU-s a start-up) only
# adds work, and
# results on the simulated clock do not depend on it. Tests of a site that dies or sleeps
# past the real round timeout set it back to two, so the other sites train meanwhile.
os.environ.setdefault("FLPLATFORM_SIMULATION_ACTORS", "1")


@pytest.fixture(autouse=True)
def site_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's sites keep their snapshots (strategies/mods/snapshots.py) to themselves."""
    directory = tmp_path / "site-state"
    monkeypatch.setenv("FLPLATFORM_SITE_STATE", str(directory))
    return directory


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Let a test build ``Message`` objects outside a running app."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id = 7
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 3
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # type: ignore[attr-defined]


@pytest.fixture
def flplatform_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private FLPLATFORM_HOME (ledger, Flower state, logs) for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FLPLATFORM_HOME", str(home))
    monkeypatch.setenv("FLWR_HOME", str(home / "flwr"))
    return home


@pytest.fixture(scope="session")
def ledger_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty SQLite ledger file, made once per session (per pytest-xdist worker:
    each has its own temporary directory). Tests never open it: they take a copy."""
    return make_template(tmp_path_factory.mktemp("ledger-template"))


@pytest.fixture
def new_sqlite_ledger(ledger_template: Path, tmp_path: Path) -> Callable[[str], str]:
    """Makes this test's own migrated, empty SQLite ledgers: ``new_sqlite_ledger(NAME)`` is
    the URL of a new one at ``tmp_path/NAME``."""
    return lambda name: copy_ledger(ledger_template, tmp_path / name)


@pytest.fixture
def sqlite_ledger(new_sqlite_ledger: Callable[[str], str]) -> str:
    """The URL of this test's own migrated, empty SQLite ledger (``tmp_path/ledger.db``)."""
    return new_sqlite_ledger("ledger.db")


@pytest.fixture
def repository(sqlite_ledger: str) -> Iterator[LedgerRepository]:
    """An open repository on this test's own migrated, empty SQLite ledger."""
    with LedgerRepository.open(sqlite_ledger) as repo:
        yield repo


@pytest.fixture
def ledger(sqlite_ledger: str) -> Iterator[tuple[LedgerRepository, int]]:
    """An open repository on this test's own ledger, and the id of the one run in it.

    Modules that need another kind of ledger (one written with runs, a URL) define their
    own ``ledger`` fixture, which takes precedence in them.
    """
    with LedgerRepository.open(sqlite_ledger) as repo:
        run_id = repo.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=3
        )
        yield repo, run_id


@pytest.fixture
def live_sigint() -> Iterator[None]:
    """SIGINT handled as in a terminal (Python's KeyboardInterrupt) for the test's duration.

    A test run started in the background by a non-interactive shell inherits SIGINT
    ignored, and the platform keeps an ignored SIGINT ignored (as that shell meant); tests
    of its SIGINT handling put Python's own handler back first.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# The longest tests first (each marker's tests are minutes: real Flower start-ups), so that
# with several workers (`make test` runs pytest-xdist) none is left to run alone at the end.
_LONGEST_FIRST = ("resume", "deploy", "hostile", "slow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        marks = {m.name for m in item.iter_markers()}
        return next(
            (i for i, name in enumerate(_LONGEST_FIRST) if name in marks), len(_LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: each group keeps its own order
