"""What ``LedgerRepository.open`` accepts: an empty database or a ledger of ours, nothing else.

A database holding another application's tables is refused and left as it was (never
migrated into a ledger); readers (``create=False``) refuse what holds no ledger rather than
create one; ``check_writable`` finds a ledger a run could not write to before any run starts.
"""

from __future__ import annotations

import sqlite3
import warnings
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from flplatform.core.errors import StorageError
from storage import LedgerRepository, mask_db_url
from storage.migrations import VERSION_TABLE, current_revisions, head_revision


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


def test_another_applications_database_is_refused_and_not_migrated(ledger_url: str) -> None:
    engine = create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)"))
        connection.execute(text("INSERT INTO customers (id, name) VALUES (1, 'Ada')"))
    engine.dispose()
    path = Path(ledger_url.removeprefix("sqlite:///"))
    before = path.read_bytes() if ledger_url.startswith("sqlite") else b""

    for create in (True, False):
        with pytest.raises(StorageError) as info:
            LedgerRepository.open(ledger_url, create=create)
        assert info.value.reason == (
            f"database {mask_db_url(ledger_url)!r} is not a flplatform ledger: it holds another "
            "application's tables (customers), and was left unchanged; pass --db with a "
            "SQLAlchemy URL such as sqlite:///runs.db (a new file or an empty database)"
        )
    assert tables(ledger_url) == {"customers"}
    if ledger_url.startswith("sqlite"):  # not even switched to WAL: the same bytes
        assert path.read_bytes() == before


def test_a_reader_creates_no_ledger_and_a_writer_does(ledger_url: str) -> None:
    with pytest.raises(StorageError, match="no ledger (at|in) .*(does not exist|is empty)"):
        LedgerRepository.open(ledger_url, create=False)
    if ledger_url.startswith("sqlite"):
        assert not Path(ledger_url.removeprefix("sqlite:///")).exists()
    else:
        assert tables(ledger_url) == set()

    LedgerRepository.open(ledger_url).close()
    with LedgerRepository.open(ledger_url, create=False) as repository:
        assert repository.list_runs() == []


def test_an_empty_sqlite_file_becomes_a_ledger(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    with pytest.raises(StorageError, match="the database is empty"):
        LedgerRepository.open(f"sqlite:///{path}", create=False)
    assert path.read_bytes() == b""
    with LedgerRepository.open(f"sqlite:///{path}") as repository:
        assert repository.list_runs() == []
    assert VERSION_TABLE in tables(f"sqlite:///{path}")


def test_a_reader_does_not_create_the_default_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "fresh"
    monkeypatch.setenv("FLPLATFORM_HOME", str(home))
    with pytest.raises(StorageError, match=f"no ledger at {home / 'ledger.db'}"):
        LedgerRepository.open(None, create=False)
    assert not home.exists()


def test_check_writable_passes_on_a_ledger_and_changes_nothing(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repository:
        repository.check_writable()
        with repository._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}


def test_check_writable_refuses_a_ledger_that_can_only_be_read(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    LedgerRepository.open(f"sqlite:///{path}").close()
    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    with LedgerRepository.open(read_only) as repository:  # opening only reads it
        assert repository.list_runs() == []
        with pytest.raises(StorageError) as info:
            repository.check_writable()
    assert info.value.reason == (
        f"cannot record runs in {read_only}: attempt to write a readonly database; make it "
        "writable or pass --db with a SQLAlchemy URL such as sqlite:///runs.db"
    )


def ledger_with_a_run(path: Path) -> None:
    with LedgerRepository.open(f"sqlite:///{path}") as repository:
        repository.create_run(name="r", strategy="s", seed=0, config={}, num_rounds_planned=1)


@pytest.mark.parametrize(
    "database, query",
    [
        ("{path}", "mode=ro"),  # SQLAlchemy warned it ignored "mode" and opened it read-write
        ("file:{path}", "mode=ro"),  # ... and then found no file named "file:..."
        ("{path}", "mode=ro&uri=true"),  # SQLite made an empty file "ledger.db?mode=ro"
        ("file:{path}", "mode=ro&uri=true"),  # what SQLAlchemy's documentation shows
    ],
)
def test_sqlite_uri_parameters_reach_sqlite_without_a_warning(
    tmp_path: Path, database: str, query: str
) -> None:
    folder = tmp_path / ("a b 100%" if database == "{path}" else "plain")
    folder.mkdir()
    path = folder / "ledger.db"
    ledger_with_a_run(path)
    url = f"sqlite:///{database.format(path=path)}?{query}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SQLAlchemy's SAWarning reached the user's terminal
        with LedgerRepository.open(url, create=False) as repository:
            assert [run.name for run in repository.list_runs()] == ["r"]
            with pytest.raises(StorageError, match="attempt to write a readonly database"):
                repository.check_writable()
    assert {p.name for p in folder.iterdir()} <= {"ledger.db", "ledger.db-wal", "ledger.db-shm"}


def test_a_ledger_in_rollback_journal_mode_is_read_through_a_read_only_url(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger_with_a_run(path)
    connection = sqlite3.connect(path)  # as a copy made by another tool may be
    connection.execute("PRAGMA journal_mode = DELETE")
    connection.close()
    before = path.read_bytes()
    # Each connection switched the file to WAL, which SQLite refuses a read-only one.
    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    with LedgerRepository.open(read_only, create=False) as repository:
        assert [run.name for run in repository.list_runs()] == ["r"]
    assert path.read_bytes() == before


def test_a_misspelt_sqlite_url_parameter_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger_with_a_run(path)
    with pytest.raises(StorageError) as info:
        LedgerRepository.open(f"sqlite:///{path}?mdoe=ro", create=False)
    # SQLite, like SQLAlchemy, would ignore it: the ledger would be opened read-write.
    assert "SQLite takes no parameter 'mdoe'; its URLs take cache, immutable, mode" in str(
        info.value
    )


@pytest.mark.postgres
def test_check_writable_refuses_a_read_only_postgres_session(postgres_database: str) -> None:
    LedgerRepository.open(postgres_database).close()
    # What a role granted only SELECT, or a hot standby, meets at its first write.
    read_only = postgres_database + "?options=-c%20default_transaction_read_only%3Don"
    with (
        LedgerRepository.open(read_only) as repository,
        pytest.raises(StorageError, match="cannot record runs in .*read-only transaction"),
    ):
        repository.check_writable()


def test_a_sqlite_path_is_shown_as_written(tmp_path: Path) -> None:
    path = tmp_path / "[/x] 100% :smile:" / "ledger.db"
    path.parent.mkdir(parents=True)
    with LedgerRepository.open(f"sqlite:///{path}") as repository:
        # The normalized URL percent-encodes the brackets, spaces and "%".
        assert repository.url == f"sqlite:///{path}"


@pytest.mark.parametrize("query", ["", "?mode=ro"])
def test_a_path_with_dotdot_after_a_link_opens_the_file_the_system_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """``link/../ledger.db`` is, to the operating system, the file beside the link's target;
    shortened as text it would be the file beside the link: another ledger."""
    target = tmp_path / "real" / "sub"
    target.mkdir(parents=True)
    (tmp_path / "link").symlink_to(target)
    beside_target, beside_link = tmp_path / "real" / "ledger.db", tmp_path / "ledger.db"
    with LedgerRepository.open(f"sqlite:///{beside_target}") as repository:
        repository.create_run(
            name="the run", config={}, strategy="local-sgd", seed=0, num_rounds_planned=1
        )
    LedgerRepository.open(f"sqlite:///{beside_link}").close()  # an empty ledger
    monkeypatch.chdir(tmp_path)
    with LedgerRepository.open(f"sqlite:///link/../ledger.db{query}", create=False) as repository:
        assert [run.name for run in repository.list_runs()] == ["the run"]
