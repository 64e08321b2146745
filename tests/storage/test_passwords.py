"""A database URL's password: split off, handed over in a password file, found by libpq.

The URL a run stores and sends holds no password (``split_password``); the password reaches
the process that connects in an in-memory password file that ``PGPASSFILE`` names
(``detach_password``), and PostgreSQL's client puts the two together again, or finds the
password in ``~/.pgpass``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from flplatform.core.errors import StorageError
from storage import LedgerRepository, ledger_id, mask_db_url
from storage.session import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    detach_password,
    password_file,
    split_password,
)


# ---------------------------------------------------------------------------- split
@pytest.mark.parametrize(
    ("url", "public", "password"),
    [
        (
            "postgresql+psycopg://alice:s3cret@db.example:5433/ledger?sslmode=require",
            "postgresql+psycopg://alice@db.example:5433/ledger?sslmode=require",
            "s3cret",
        ),
        # Percent-encoded in the URL, the password itself once split.
        (
            "postgresql+psycopg://alice:p%40ss%3Aw@db/ledger",
            "postgresql+psycopg://alice@db/ledger",
            "p@ss:w",
        ),
        # libpq's keyword in the query string, which psycopg passes on.
        (
            "postgresql+psycopg://alice@db/ledger?password=s3cret&sslmode=require",
            "postgresql+psycopg://alice@db/ledger?sslmode=require",
            "s3cret",
        ),
    ],
)
def test_the_password_is_split_off_and_the_rest_kept(url: str, public: str, password: str) -> None:
    assert split_password(url) == (public, password)
    assert make_url(public).password is None
    # Still the same ledger (its checkpoints' directory too).
    assert ledger_id(public) == ledger_id(url)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://alice@db.example/ledger",
        "postgresql+psycopg://db.example/ledger",
        "sqlite:////tmp/runs.db",
        "sqlite://",
    ],
)
def test_a_url_without_a_password_is_returned_as_given(url: str) -> None:
    assert split_password(url) == (url, None)


def test_a_url_that_cannot_be_parsed_is_refused_without_echoing_its_password() -> None:
    with pytest.raises(StorageError, match="cannot parse database URL") as info:
        split_password("postgresql+psycopg://alice:s3cret@db:notaport/ledger")
    assert "s3cret" not in info.value.reason
    assert "alice:***@db:notaport" in info.value.reason


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://alice:s3cret@db/ledger", "postgresql+psycopg://alice:***@db/ledger"),
        (
            "postgresql+psycopg://alice@db/ledger?password=s3cret",
            "postgresql+psycopg://alice@db/ledger?password=%2A%2A%2A",
        ),
        (
            "postgresql+psycopg://alice:s3cret@db:notaport/x",
            "postgresql+psycopg://alice:***@db:notaport/x",
        ),
        # Too malformed to parse, with "/" in the password.
        ("postgresql://alice:s3/cr@t@db:notaport/x", "postgresql://alice:***@db:notaport/x"),
        # ... or in the query
        (
            "postgresql+psycopg://u@h:notaport/db?sslmode=require&password=s3cret",
            "postgresql+psycopg://u@h:notaport/db?sslmode=require&password=***",
        ),
    ],
)
def test_masking_hides_the_password_wherever_the_url_holds_it(url: str, shown: str) -> None:
    assert mask_db_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+nosuchdriver://u@h/db?password=s3cret",  # a driver not installed
        "nosuch://u@h/db?password=s3cret",  # an unknown dialect
        "postgresql+psycopg://u@h:notaport/db?password=s3cret",  # unparsable
    ],
)
def test_a_ledger_that_cannot_be_opened_is_named_without_its_query_password(url: str) -> None:
    """The messages named the URL with SQLAlchemy's hide_password, which hides the user's
    password only, not the query's (libpq's ``password=``)."""
    with pytest.raises(StorageError) as info:
        LedgerRepository.open(url)
    assert "s3cret" not in info.value.reason and "password=" in info.value.reason


# ---------------------------------------------------------------------------- detach
def test_a_postgresql_password_is_handed_over_in_an_owner_only_file_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    url = "postgresql+psycopg://alice:s3:c\\ret@db:5433/ledger"
    public, environment = detach_password(url)
    assert public == "postgresql+psycopg://alice@db:5433/ledger"
    assert list(environment) == [PASSWORD_FILE_ENV]
    path = Path(environment[PASSWORD_FILE_ENV])
    assert path.parent == Path(f"/proc/{os.getpid()}/fd")
    assert "s3" not in str(path)
    # ~/.pgpass's format, ':' and '\\' escaped; owner-only, or libpq ignores it
    assert path.read_text() == "db:5433:ledger:alice:s3\\:c\\\\ret\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.readlink(path).startswith("/memfd:flplatform-pgpass")  # on no disk
    # Another process of this user reads it while this one lives (the run's ServerApp).
    read = subprocess.run(
        [sys.executable, "-c", f"print(open({str(path)!r}).read(), end='')"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert read.stdout == path.read_text()
    assert detach_password(url) == (public, environment)  # one file per password


def test_a_password_from_the_environment_moves_into_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "fr0m-env")
    public, environment = detach_password("postgresql+psycopg://alice@db/ledger")
    assert public == "postgresql+psycopg://alice@db/ledger"
    assert Path(environment[PASSWORD_FILE_ENV]).read_text() == "db:*:ledger:alice:fr0m-env\n"
    # and Flower's processes are started without it in their environment
    from flplatform.launch.flower import flower_environment

    assert PASSWORD_ENV not in flower_environment(tmp_path)


def test_unset_fields_match_anything() -> None:
    path = Path(password_file("postgresql+psycopg:///ledger", "pw") or "")
    assert path.read_text() == "*:*:ledger:*:pw\n"


def test_a_password_with_a_line_break_is_refused_without_echoing_it() -> None:
    for password in ("p\nq", "p\rq"):
        with pytest.raises(StorageError, match="with a line break") as info:
            detach_password(f"postgresql+psycopg://alice:{password}@db/ledger")
        assert password not in info.value.reason


def test_without_memfd_the_password_goes_in_the_environment_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "memfd_create")  # as on macOS
    assert detach_password("postgresql+psycopg://alice:s3cret@db/elsewhere") == (
        "postgresql+psycopg://alice@db/elsewhere",
        {PASSWORD_ENV: "s3cret"},
    )


def test_nothing_is_handed_over_without_a_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert detach_password("postgresql+psycopg://alice@db/ledger") == (
        "postgresql+psycopg://alice@db/ledger",
        {},
    )
    assert detach_password("sqlite:////tmp/runs.db") == ("sqlite:////tmp/runs.db", {})
    assert detach_password("") == ("", {})  # the default ledger


def test_the_password_of_another_backend_is_refused_without_echoing_it() -> None:
    with pytest.raises(StorageError, match="only a PostgreSQL password travels") as info:
        detach_password("mysql+pymysql://alice:s3cret@db/ledger")
    assert "s3cret" not in info.value.reason


# ---------------------------------------------------------------------------- libpq, for real
@pytest.fixture
def no_password_around(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Neither PGPASSWORD nor the user's own ~/.pgpass: a password file of the test's own."""
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    passfile = tmp_path / "pgpass"
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    return passfile


@pytest.mark.postgres
def test_libpq_takes_the_password_from_the_file_handed_over(
    password_database: str, no_password_around: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, environment = detach_password(password_database)
    with pytest.raises(StorageError, match=r"no password supplied \(the password comes from"):
        LedgerRepository.open(public)

    monkeypatch.setenv(PASSWORD_FILE_ENV, environment[PASSWORD_FILE_ENV])
    with LedgerRepository.open(public) as repository:
        repository.check_writable()

    wrong = password_file(public, "wrong")
    assert wrong is not None
    monkeypatch.setenv(PASSWORD_FILE_ENV, wrong)
    with pytest.raises(StorageError, match="password authentication failed") as info:
        LedgerRepository.open(public)
    assert make_url(password_database).password not in info.value.reason


@pytest.mark.postgres
def test_libpq_takes_the_password_from_pgpassword(
    password_database: str, no_password_around: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, password = split_password(password_database)
    assert password
    monkeypatch.setenv(PASSWORD_ENV, password)  # the user's own way, for the command
    with LedgerRepository.open(public) as repository:
        repository.check_writable()


@pytest.mark.postgres
def test_libpq_takes_the_password_from_the_password_file(
    password_database: str, no_password_around: Path
) -> None:
    url = make_url(password_database)
    public, _ = split_password(password_database)
    no_password_around.write_text(
        f"{url.host}:{url.port}:{url.database}:{url.username}:{url.password}\n"
    )
    no_password_around.chmod(0o600)  # libpq ignores a password file others may read

    with LedgerRepository.open(public) as repository:
        repository.check_writable()
