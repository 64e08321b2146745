"""Fixtures running the ledger contract on every backend: a SQLite file and PostgreSQL.

PostgreSQL comes from ``$FLPLATFORM_TEST_POSTGRES_URL`` (a server the CI provides; its user
must be allowed to create databases) or, when that is unset, from a throwaway cluster this
module starts with the local ``initdb``/``pg_ctl`` on 127.0.0.1 and stops at the end of the
session. Each test gets a fresh database, so tests never see each other's rows. When psycopg or
the server binaries are missing, the PostgreSQL parameters are skipped with the reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from storage import LedgerRepository

POSTGRES_URL_ENV = "FLPLATFORM_TEST_POSTGRES_URL"
# initdb refuses to run as root; this unprivileged account owns the throwaway cluster.
POSTGRES_OS_USER = "postgres"

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _postgres_bin_dir() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        return Path(initdb).resolve().parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _as_cluster_owner() -> tuple[list[str], int | None, int | None]:
    """Command prefix running a program as the cluster's owner, and that owner's uid/gid."""
    if os.geteuid() != 0:
        return [], None, None
    try:
        owner = pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        pytest.skip(
            f"running as root and there is no {POSTGRES_OS_USER!r} user to run initdb as "
            "(initdb refuses root); install the postgresql package or run as a normal user"
        )
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("running as root and `runuser` is missing; cannot start PostgreSQL")
    return [runuser, "-u", POSTGRES_OS_USER, "--"], owner.pw_uid, owner.pw_gid


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of a PostgreSQL maintenance database on a server that lives for the session."""
    pytest.importorskip(
        "psycopg",
        reason="psycopg is not installed: pip install 'psycopg[binary]'",
        exc_type=ImportError,
    )
    configured = os.environ.get(POSTGRES_URL_ENV)
    if configured:
        yield configured
        return
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(
            "PostgreSQL server binaries (initdb, pg_ctl) not found; apt-get install postgresql "
            f"or set {POSTGRES_URL_ENV}"
        )
    prefix, uid, gid = _as_cluster_owner()
    # Not pytest's tmp_path: it lives under a 0700 directory of root the owner cannot enter.
    root = Path(tempfile.mkdtemp(prefix="flplatform-pg-"))
    if uid is not None and gid is not None:
        os.chown(root, uid, gid)
    data, port = root / "data", free_port()
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}

    def run(*args: str) -> None:
        subprocess.run([*prefix, *args], check=True, capture_output=True, env=env, timeout=60)

    try:
        run(
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        # Durability settings off: a test cluster is thrown away, and they halve start-up.
        options = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        run(
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(root / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            "30",
            "start",
        )
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"could not start a PostgreSQL test cluster: {exc.stderr.decode()[-500:]}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            env=env,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)


def _create_database(admin_url: str) -> str:
    """Create an empty database on the server of ``admin_url``; return its URL."""
    import psycopg

    admin = make_url(admin_url)
    name = f"ledger_{uuid.uuid4().hex[:12]}"
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as connection:
        try:
            # FILE_COPY is much faster than PostgreSQL 15's default for a tiny template.
            connection.execute(f'CREATE DATABASE "{name}" STRATEGY FILE_COPY')
        except psycopg.errors.SyntaxError:  # PostgreSQL < 15 has no STRATEGY option
            connection.execute(f'CREATE DATABASE "{name}"')
    return admin.set(database=name).render_as_string(hide_password=False)


def _drop_database(admin_url: str, url: str) -> None:
    import psycopg

    conninfo = make_url(admin_url).set(drivername="postgresql")
    name = make_url(url).database
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_database(postgres_server: str) -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database, dropped after the test."""
    url = _create_database(postgres_server)
    try:
        yield url
    finally:
        _drop_database(postgres_server, url)


@pytest.fixture(scope="session")
def postgres_ledger(postgres_server: str) -> Iterator[str]:
    """URL of one migrated PostgreSQL ledger that the ``repo`` fixture empties per test.

    Creating a database costs ~0.1-0.2 s; emptying the tables costs milliseconds. Tests that
    need a database no migration has touched use ``ledger_url`` instead.
    """
    url = _create_database(postgres_server)
    LedgerRepository.open(url).close()
    try:
        yield url
    finally:
        _drop_database(postgres_server, url)


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
            url = _create_database(str(request.getfixturevalue("postgres_server")))
        created.append(url)
        return url

    yield new_url
    if request.param != "sqlite":
        for url in created:
            _drop_database(str(request.getfixturevalue("postgres_server")), url)


@pytest.fixture(params=BACKENDS)
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LedgerRepository]:
    """An open repository over an empty, migrated ledger on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
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
