"""A database password given in ``--db`` is stored nowhere and printed nowhere, for real.

A real simulation on PostgreSQL, as a role that must log in with its password
(``password_database``, tests/postgres.py): the password travels to the ServerApp in an
in-memory password file the command holds (``storage.session.detach_password``). Afterwards
no file under the platform's home (logs, run configs, the SuperLink's database,
checkpoints), no row of the ledger and no output of ``simulate`` or ``history runs`` holds
it; the files that may hold what a run was given are its owner's only. While the run goes
on, no process the command started (SuperLink, SuperExec, the simulation, Ray's) holds it
in its environment or command line, whether the user gave it in the URL or as
``PGPASSWORD``. A run whose ledger URL holds no password (as the ledger records it)
resumes with the password from the environment.
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.core.errors import StorageError
from storage import LedgerRepository
from storage.session import PASSWORD_ENV, split_password
from tests.helpers.processes import (
    Leftovers,
    cmdline,
    flplatform_cli,
    kill_after,
    wait_for_rounds,
    wait_ok,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
runner = CliRunner()
ROUNDS = 8  # of the run killed, then resumed to its end


def files_holding(root: Path, secret: str) -> list[Path]:
    """Every file under ``root`` whose bytes contain ``secret``."""
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def rows_holding(url: str, secret: str) -> list[str]:
    """``table: row`` for every row of every table of the ledger at ``url`` holding it."""
    found = []
    with LedgerRepository.open(url) as repository, repository._engine.connect() as connection:
        tables = connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        for table in list(tables):
            rows = connection.execute(text(f'SELECT t::text FROM "{table}" t')).scalars()
            found += [f"{table}: {row}" for row in rows if secret in row]
    return found


def started_holding(leftovers: Leftovers, secret: str, command: int) -> list[str]:
    """The processes below ``command`` (running now) whose environment or command line
    holds ``secret``: ``pid part command line`` each."""
    found = []
    for pid in leftovers.running():
        if pid == command:
            continue  # the user's own command: what they typed, their environment
        for part in ("environ", "cmdline"):
            with contextlib.suppress(OSError):
                if secret.encode() in Path(f"/proc/{pid}/{part}").read_bytes():
                    found.append(f"{pid} {part} {cmdline(pid)}")
    return found


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def shows(output: str, secret: str) -> bool:
    """Whether ``output`` shows ``secret``, also cut by a line break or a table's border."""
    return secret in output or secret in "".join(output.replace("│", " ").split())


@pytest.fixture
def no_password_around(flplatform_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither PGPASSWORD nor the user's own ~/.pgpass gives this test's role a password."""
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.setenv("PGPASSFILE", str(flplatform_home / "no-pgpass"))


@pytest.mark.usefixtures("no_password_around")
def test_a_password_in_the_url_reaches_the_serverapp_and_is_kept_nowhere(
    flplatform_home: Path, password_database: str
) -> None:
    password = make_url(password_database).password
    assert password
    public, _ = split_password(password_database)
    with pytest.raises(StorageError, match="no password supplied"):
        LedgerRepository.open(public)  # the role cannot log in without it

    simulate = runner.invoke(
        app,
        ["simulate", "--sites", "2", "--rounds", "2", "--local-epochs", "1"]
        + ["--db", password_database],
    )
    assert simulate.exit_code == 0, simulate.output
    assert "finished" in simulate.output
    outputs = {"simulate": simulate.output}
    for fmt in ("json", "csv", "table"):
        shown = runner.invoke(app, ["history", "runs", "--db", password_database, "-f", fmt])
        assert shown.exit_code == 0, shown.output
        outputs[f"history runs -f {fmt}"] = shown.output
    assert public.split("//")[1] in outputs["history runs -f json"]  # the URL, no password

    assert [name for name, output in outputs.items() if shows(output, password)] == []
    assert files_holding(flplatform_home, password) == []
    assert rows_holding(password_database, password) == []
    # What was searched: the run config Flower got, and the SuperLink's database holding it.
    logs = flplatform_home / "logs"
    [run_config] = logs.glob("*.run-config.toml")
    assert f'"db" = "{public}"' in run_config.read_text()
    assert list(logs.glob("*.superlink.db"))
    with LedgerRepository.open(password_database) as repository:
        [run] = repository.list_runs()
    assert run.status == "finished" and run.config["db"] == public

    # Owner-only: the logs directory and every file in it, the SuperLink's database included.
    assert mode(logs) == 0o700
    assert {p.name: mode(p) for p in logs.iterdir()} == {p.name: 0o600 for p in logs.iterdir()}


@pytest.mark.resume
@pytest.mark.usefixtures("no_password_around")
def test_a_run_recorded_without_its_password_resumes_with_it_from_the_environment(
    flplatform_home: Path, password_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, password = split_password(password_database)
    assert password
    log = tmp_path / "cli.log"
    # Rounds to spare after each look: a probe reads every process's environment while the
    # command runs, and a loaded machine's resume finished a 4-round run meanwhile.
    simulate = ["simulate", "--sites", "2", "--rounds", str(ROUNDS), "--local-steps", "2"]
    cli = flplatform_cli([*simulate, "--db", password_database], tmp_path, log)
    probed: dict[str, tuple[int, list[str]]] = {}

    def probe(name: str, command: int) -> Callable[[Leftovers], None]:
        def look(leftovers: Leftovers) -> None:
            running = leftovers.running()
            probed[name] = (len(running), started_holding(leftovers, password, command))

        return look

    run_id = kill_after(cli, password_database, None, 1, probe=probe("url", cli.pid))

    # The ledger names the database without the password; the user gives it as PGPASSWORD.
    monkeypatch.setenv(PASSWORD_ENV, password)
    resume = flplatform_cli(["resume", str(run_id), "--db", public], tmp_path, log)
    with LedgerRepository.open(public) as repository:  # killed after round 1, or just after
        done = repository.get_run(run_id).rounds_completed
    # Looked at once the resume committed a round of its own: its processes are all up.
    probe("env", resume.pid)(wait_for_rounds(resume, public, run_id, done + 1, resumes=1)[1])
    for name, (running, holding) in probed.items():
        # SuperLink, SuperExec, the simulation and Ray's processes were looked at
        assert running >= 5 and holding == [], (name, running, holding)
    wait_ok(resume, log)

    with LedgerRepository.open(public) as repository:
        run = repository.get_run(run_id)
        events = [event.kind for event in repository.list_events(run_id)]
    assert run.status == "finished" and run.rounds_completed == ROUNDS
    assert run.config["db"] == public
    assert "resumed" in events
    assert not shows(log.read_text(), password)
    assert files_holding(flplatform_home, password) == []
