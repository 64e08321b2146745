"""A PostgreSQL server for the tests, on every machine ``make test`` runs on.

Registered for the whole suite by ``tests/conftest.py`` (``pytest_plugins``): any test may
take ``postgres_database`` (the URL of a fresh, empty database, dropped after the test) or
``password_database`` (the same, owned by a role that must log in with its password).

Where the server comes from, first found first:

1. ``$FLPLATFORM_TEST_POSTGRES_URL``: a server someone provides (its URL names a user that
   may create databases and roles, a maintenance database such as ``postgres``, and needs no
   password or carries it; the server must ask other roles for their passwords over TCP, as
   PostgreSQL's Docker image does). Nothing is started.
2. A throwaway cluster this module starts on 127.0.0.1 for the test session (``initdb``,
   then ``pg_ctl start``; stopped and deleted at the end, or by a watcher once the test
   process is gone, also when it was killed with SIGKILL), with the server binaries of
   ``$FLPLATFORM_TEST_POSTGRES_BIN`` (a directory holding ``initdb`` and ``pg_ctl``), else
   the system's (``initdb`` on ``PATH``, else Debian's ``/usr/lib/postgresql/*/bin``), else
   those the PyPI package ``pgserver`` ships in its wheel (in the ``dev`` extra, so a fresh
   machine has them after ``make setup-dev``).

``initdb`` and ``postgres`` refuse to run as root, and CI runs ``make test`` as root. Then
the cluster is run as ``nobody`` (an account every Linux system has: none is created) by
Python's own switch of user and group for the child (``subprocess``'s ``user=``/``group=``);
its directory, under the system's temporary directory, is given to ``nobody``. ``nobody`` may
not be able to reach a virtual environment under ``/root`` (mode 0700), so pgserver's
binaries are first linked (or copied) into that directory. pgserver's own ``PostgresServer``
is not used: as root it creates a ``pgserver`` account and opens every parent directory of
its data and binaries to all users, which a test suite should not do to a machine; it also
listens on a Unix socket only, where the tests and Flower's processes need 127.0.0.1. As a
normal user, everything runs as that user and nothing is linked.

The cluster trusts its ``postgres`` superuser on 127.0.0.1 and asks every other role for its
password (SCRAM), so that a test can prove a password reaches the process that needs it.

Without psycopg or any server binaries, tests that need PostgreSQL are skipped with the
reason, unless ``$FLPLATFORM_REQUIRE_POSTGRES`` is ``1`` (the Makefile's ``test`` target sets
it: there the server is meant to be provided, and a skip would hide that it was not); then
they fail with the same reason.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from sqlalchemy.engine import make_url

POSTGRES_URL_ENV = "FLPLATFORM_TEST_POSTGRES_URL"
POSTGRES_BIN_ENV = "FLPLATFORM_TEST_POSTGRES_BIN"
REQUIRE_POSTGRES_ENV = "FLPLATFORM_REQUIRE_POSTGRES"
# Where Debian's postgresql packages put the server binaries (not on PATH).
SYSTEM_POSTGRES_BIN_GLOB = "/usr/lib/postgresql/*/bin"
# The unprivileged account that runs the cluster when the tests run as root.
CLUSTER_OWNER_AS_ROOT = "nobody"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason``; fail it when the server was meant to be provided."""
    if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
        pytest.fail(
            f"{reason} ({REQUIRE_POSTGRES_ENV}=1: `make test` provides PostgreSQL, through "
            "pgserver in the dev extra; run `make setup-dev`)",
            pytrace=False,
        )
    pytest.skip(reason)


# ------------------------------------------------------------------ server binaries
def bundled_bin_dir() -> Path | None:
    """pgserver's PostgreSQL binaries, found without importing it (its import has effects)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        return None
    bin_dir = Path(spec.origin).parent / "pginstall" / "bin"
    return bin_dir if (bin_dir / "initdb").is_file() else None


def _holds_server(directory: Path) -> bool:
    return (directory / "initdb").is_file() and (directory / "pg_ctl").is_file()


def postgres_bin_dir() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl`` to start a cluster with (module docstring)."""
    configured = os.environ.get(POSTGRES_BIN_ENV)
    if configured:
        return Path(configured)
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        return Path(initdb).resolve().parent
    system = [Path(p) for p in glob.glob(SYSTEM_POSTGRES_BIN_GLOB) if _holds_server(Path(p))]
    if system:  # the newest: /usr/lib/postgresql/16/bin before .../9.6/bin
        return max(system, key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)])
    return bundled_bin_dir()


def _stage_bundled(bin_dir: Path, into: Path) -> Path:
    """Link pgserver's installation into ``into``; return the linked ``bin`` directory.

    The wheel's layout is kept: its binaries find their libraries by a path relative to
    themselves (``$ORIGIN/../../../pgserver.libs``).
    """
    install = bin_dir.parent  # pgserver/pginstall
    libs = install.parent.parent / "pgserver.libs"

    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # another file system
            shutil.copy2(source, target)

    staged = into / "pgserver" / "pginstall"
    shutil.copytree(install, staged, symlinks=True, copy_function=link_or_copy)
    if libs.is_dir():
        shutil.copytree(libs, into / "pgserver.libs", symlinks=True, copy_function=link_or_copy)
    return staged / "bin"


# ------------------------------------------------------------------ the cluster
@dataclass(frozen=True)
class Cluster:
    """How to run the cluster's programs: where they are, and as whom."""

    bin_dir: Path
    root: Path
    owner: pwd.struct_passwd | None  # None: the current user

    def run(self, program: str, *args: str, check: bool = True) -> None:
        as_owner: dict[str, Any] = (
            {"user": self.owner.pw_uid, "group": self.owner.pw_gid, "extra_groups": []}
            if self.owner is not None
            else {}
        )
        subprocess.run(
            [str(self.bin_dir / program), *args],
            check=check,
            capture_output=True,
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
            cwd=self.root,
            timeout=60,
            **as_owner,
        )


def _cluster_owner() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(CLUSTER_OWNER_AS_ROOT)
    except KeyError:
        unavailable(
            f"running as root, and there is no {CLUSTER_OWNER_AS_ROOT!r} account to run "
            "PostgreSQL as (initdb refuses root)"
        )


# The superuser may connect without a password; every other role must give its own.
_PG_HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of a PostgreSQL maintenance database on a server that lives for the session."""
    if importlib.util.find_spec("psycopg") is None:
        unavailable("psycopg is not installed: pip install 'psycopg[binary]'")
    configured = os.environ.get(POSTGRES_URL_ENV)
    if configured:
        yield configured
        return
    for url, _ in throwaway_cluster():
        yield url


def throwaway_cluster() -> Iterator[tuple[str, Path]]:
    """Start a cluster (the module's 2.), yield its maintenance URL and directory, then
    stop and delete it; also once this process is gone, killed or not (``_stop_when_gone``)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None or not _holds_server(bin_dir):
        where = f" in {POSTGRES_BIN_ENV}={bin_dir}" if os.environ.get(POSTGRES_BIN_ENV) else ""
        unavailable(
            f"PostgreSQL server binaries (initdb, pg_ctl) not found{where}: pip install "
            f"pgserver (the dev extra), apt-get install postgresql, or set {POSTGRES_URL_ENV}"
        )
    owner = _cluster_owner()
    # Not pytest's tmp_path: it lives under a 0700 directory of root the owner cannot enter.
    root = Path(tempfile.mkdtemp(prefix="flplatform-pg-"))
    if owner is not None:
        if bin_dir == bundled_bin_dir():
            bin_dir = _stage_bundled(bin_dir, root / "pgserver-install")
        os.chown(root, owner.pw_uid, owner.pw_gid)
    cluster = Cluster(bin_dir=bin_dir, root=root, owner=owner)
    data, port = root / "data", free_port()
    try:
        cluster.run(
            "initdb",
            *("-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8"),
            *("--no-sync", "--no-instructions"),
        )
        (data / "pg_hba.conf").write_text(_PG_HBA)
        # Durability settings off: a test cluster is thrown away, and they halve start-up.
        options = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        cluster.run(
            "pg_ctl",
            *("-D", str(data), "-l", str(root / "server.log"), "-o", options),
            *("-w", "-t", "30", "start"),
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log = root / "server.log"
        said = getattr(exc, "stderr", None) or b""
        detail = (said.decode(errors="replace") or str(exc))[-500:]
        if log.is_file():
            detail += " " + log.read_text(errors="replace")[-500:]
        shutil.rmtree(root, ignore_errors=True)
        unavailable(f"could not start a PostgreSQL test cluster with {bin_dir}: {detail}")
    _stop_when_gone(os.getpid(), data, root)
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", root
    finally:
        cluster.run("pg_ctl", "-D", str(data), "-m", "immediate", "stop", check=False)
        shutil.rmtree(root, ignore_errors=True)


def _stop_when_gone(pid: int, data: Path, root: Path) -> None:
    """Stop the cluster (SIGQUIT to its postmaster: an immediate shutdown) and delete it
    once process ``pid`` is gone: a test session killed with SIGKILL runs no ``finally``,
    and its server would run on. After a normal stop there is nothing left to do."""
    postmaster = shlex.quote(str(data / "postmaster.pid"))
    script = (
        f"while kill -0 {pid} 2>/dev/null; do sleep 1; done; "
        f'kill -QUIT "$(head -n 1 {postmaster} 2>/dev/null)" 2>/dev/null; '
        f"sleep 1; rm -rf {shlex.quote(str(root))}"
    )
    subprocess.Popen(
        ["sh", "-c", script],
        start_new_session=True,  # not in the session's process group: it outlives a kill
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# ------------------------------------------------------------------ databases
def _admin(admin_url: str, statement: str) -> None:
    """Run one statement (outside a transaction) as the server's administrator."""
    import psycopg

    conninfo = make_url(admin_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as c:
        c.execute(statement)  # type: ignore[arg-type]  # test-made names, not user input


def create_database(admin_url: str, *, owner: str | None = None) -> str:
    """Create an empty database on the server of ``admin_url``; return its URL (as admin)."""
    import psycopg

    name = f"ledger_{uuid.uuid4().hex[:12]}"
    owned = f' OWNER "{owner}"' if owner else ""
    try:
        # FILE_COPY is much faster than PostgreSQL 15's default for a tiny template.
        _admin(admin_url, f'CREATE DATABASE "{name}"{owned} STRATEGY FILE_COPY')
    except psycopg.errors.SyntaxError:  # PostgreSQL < 15 has no STRATEGY option
        _admin(admin_url, f'CREATE DATABASE "{name}"{owned}')
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_database(admin_url: str, url: str) -> None:
    """Drop the database of ``url``, disconnecting whoever is still connected."""
    _admin(admin_url, f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


@pytest.fixture
def postgres_database(postgres_server: str) -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database, dropped after the test."""
    url = create_database(postgres_server)
    try:
        yield url
    finally:
        drop_database(postgres_server, url)


@pytest.fixture
def password_database(postgres_server: str) -> Iterator[str]:
    """URL, password included, of a fresh database owned by a new role that needs it.

    The password is letters and digits only, so it reads the same in every encoding (a test
    looking for it in files and outputs finds every copy). Role and database are dropped
    after the test.
    """
    role = f"flp_{uuid.uuid4().hex[:10]}"
    password = f"Pw{secrets.token_hex(12)}"
    _admin(postgres_server, f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'")
    url = create_database(postgres_server, owner=role)
    try:
        yield (
            make_url(url)
            .set(username=role, password=password)
            .render_as_string(hide_password=False)
        )
    finally:
        drop_database(postgres_server, url)
        _admin(postgres_server, f'DROP ROLE IF EXISTS "{role}"')
