"""A database URL's password: split off, handed over in the environment, found by libpq.

The URL a run stores and sends holds no password (``split_password``); the password reaches
the process that connects as ``PGPASSWORD`` (``detach_password``), and PostgreSQL's client
puts the two together again, or finds the password in ``~/.pgpass``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from flplatform.core.errors import StorageError
from storage import LedgerRepository, ledger_id, mask_db_url
from storage.session import PASSWORD_ENV, detach_password, split_password


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
    ],
)
def test_masking_hides_the_password_wherever_the_url_holds_it(url: str, shown: str) -> None:
    assert mask_db_url(url) == shown


# ---------------------------------------------------------------------------- detach
def test_a_postgresql_password_is_handed_over_as_pgpassword() -> None:
    url = "postgresql+psycopg://alice:s3cret@db/ledger"

    assert detach_password(url) == (
        "postgresql+psycopg://alice@db/ledger",
        {PASSWORD_ENV: "s3cret"},
    )


def test_nothing_is_handed_over_without_a_password() -> None:
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
def test_libpq_takes_the_password_from_pgpassword(
    password_database: str, no_password_around: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, environment = detach_password(password_database)
    with pytest.raises(StorageError, match=r"no password supplied \(the password comes from"):
        LedgerRepository.open(public)

    monkeypatch.setenv(PASSWORD_ENV, environment[PASSWORD_ENV])
    with LedgerRepository.open(public) as repository:
        repository.check_writable()

    monkeypatch.setenv(PASSWORD_ENV, "wrong")
    with pytest.raises(StorageError, match="password authentication failed") as info:
        LedgerRepository.open(public)
    assert environment[PASSWORD_ENV] not in info.value.reason


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
