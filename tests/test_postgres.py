"""Where tests/postgres.py finds PostgreSQL's server binaries, and when it may skip.

That its server asks every role but the superuser for a password is tested where that
matters (tests/storage/test_passwords.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.postgres as pg

ROOT = Path(__file__).resolve().parents[1]


def fake_server(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for program in ("initdb", "pg_ctl"):
        (directory / program).write_text("#!/bin/sh\n")
        (directory / program).chmod(0o755)
    return directory


@pytest.fixture
def no_system_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH and Debian's directory without PostgreSQL, as on a fresh machine."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(pg.POSTGRES_BIN_ENV, raising=False)
    monkeypatch.setattr(pg, "SYSTEM_POSTGRES_BIN_GLOB", str(tmp_path / "debian" / "*" / "bin"))
    return tmp_path


def test_a_fresh_machine_falls_back_to_the_binaries_pgserver_ships(no_system_server: Path) -> None:
    bundled = pg.bundled_bin_dir()
    if bundled is None:
        pg.unavailable("pgserver is not installed (the dev extra)")
    assert pg.postgres_bin_dir() == bundled
    assert os.access(bundled / "initdb", os.X_OK) and os.access(bundled / "pg_ctl", os.X_OK)


def test_the_systems_binaries_come_first_the_newest_release_first(
    no_system_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for release in ("9.6", "16", "15"):
        fake_server(no_system_server / "debian" / release / "bin")
    assert pg.postgres_bin_dir() == no_system_server / "debian" / "16" / "bin"

    on_path = fake_server(no_system_server / "local" / "bin")
    monkeypatch.setenv("PATH", str(on_path))
    assert pg.postgres_bin_dir() == on_path

    chosen = no_system_server / "chosen"
    monkeypatch.setenv(pg.POSTGRES_BIN_ENV, str(chosen))
    assert pg.postgres_bin_dir() == chosen


def test_without_a_server_the_tests_skip_unless_make_test_requires_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(pg.REQUIRE_POSTGRES_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no server"):
        pg.unavailable("no server")
    monkeypatch.setenv(pg.REQUIRE_POSTGRES_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no server .*make test"):
        pg.unavailable("no server")


def test_a_session_killed_with_sigkill_leaves_no_server_running() -> None:
    # A SIGKILLed test process runs no `finally`: the cluster's watcher stops and deletes it.
    if os.environ.get(pg.POSTGRES_URL_ENV):
        pytest.skip("a server someone provides is not this module's to stop")
    if pg.postgres_bin_dir() is None or importlib.util.find_spec("psycopg") is None:
        pg.unavailable("no PostgreSQL server binaries or no psycopg")
    code = (
        "import os, signal\n"
        "from tests.postgres import throwaway_cluster\n"
        "cluster = throwaway_cluster()  # held: a collected generator would stop it\n"
        "url, root = next(cluster)\n"
        "print(url, root, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    url, root = done.stdout.split()
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    deadline = time.monotonic() + 20
    while Path(root).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(root).exists()
    with socket.socket() as probe:  # nothing listens on its port any more
        assert probe.connect_ex(("127.0.0.1", port)) != 0
