"""The command that owns a simulation: named by pid and start time, and gone when it ends
(flplatform/run/owner.py); a run whose owner is gone takes no more rounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flplatform.core.errors import RunFailed
from flplatform.run.owner import OWNER_ENV, named_owner, owner_gone, owner_token
from flplatform.run.start import start
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import MODEL, site

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")


def ended_process_token() -> str:
    """The token of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = owner_token(child.pid)
    child.wait()
    assert token is not None
    return token


def test_a_running_command_is_not_gone_and_an_ended_one_is() -> None:
    me = owner_token()
    assert me is not None and named_owner({OWNER_ENV: me}) is not None
    assert not owner_gone({OWNER_ENV: me})
    assert owner_gone({OWNER_ENV: ended_process_token()})


def test_a_later_process_with_the_same_pid_is_not_the_owner() -> None:
    pid, started = me = named_owner({OWNER_ENV: owner_token() or ""}) or (0, 0)
    assert me != (0, 0)
    assert owner_gone({OWNER_ENV: f"{pid}:{started + 1}"})


@pytest.mark.parametrize("token", ["", "abc", "12", "12:", ":5", "-1:3"])
def test_nobody_named_is_never_gone(token: str) -> None:
    assert named_owner({OWNER_ENV: token}) is None
    assert not owner_gone({OWNER_ENV: token})
    assert not owner_gone({})


@pytest.mark.usefixtures("task_identity")
def test_a_run_whose_command_is_gone_records_no_round(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OWNER_ENV, ended_process_token())
    grid = ScriptedGrid({1: site("a"), 2: site("b")})
    with pytest.raises(RunFailed, match="the command that started run 1 is gone"):
        start(LocalSGDAveraging(), grid, MODEL, num_rounds=3, ledger=sqlite_ledger)
    with LedgerRepository.open(sqlite_ledger) as repo:
        (run,) = repo.list_runs()
        assert repo.list_rounds(run.id) == []
