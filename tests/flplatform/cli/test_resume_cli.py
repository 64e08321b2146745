"""`flplatform resume`: what it refuses before anything starts, each in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flplatform.run.ledger import process_owner
from flplatform.run.run_record import DEPLOYED_EVENT, LAUNCH_KEY
from storage import LedgerRepository
from tests.helpers.cli import invoke, one_error_line
from tests.helpers.resumable_runs import record_run, simulate_config


@pytest.fixture
def url(sqlite_ledger: str) -> str:
    return sqlite_ledger


def test_a_deployed_run_is_refused_rather_than_trained_on_this_machine(
    url: str, tmp_path: Path
) -> None:
    """Its sites' data files may sit beside the server (the split step writes them there):
    a local simulation would train on them and credit the sites."""
    run_id = record_run(url, tmp_path, config=simulate_config("t9"), tag="t9", rounds=2)
    with LedgerRepository.open(url) as repo:
        repo.add_event(run_id, DEPLOYED_EVENT, {"sites": ["london", "ohio"], "address": "x:1"})

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    assert one_error_line(result.output).endswith(
        f"run {run_id} trained on the sites of a deployment (london, ohio): `flplatform "
        "resume` would train it on this machine, on data that belongs at the sites; resume "
        f"it on them with `flplatform server --resume {run_id}` and the deployment's --certs"
    )
    with LedgerRepository.open(url) as repo:  # untouched: not reopened, no event added
        assert repo.get_run(run_id).status == "running"
        assert [e.kind for e in repo.list_events(run_id)] == [DEPLOYED_EVENT]


def test_a_deployed_run_is_refused_however_the_resume_is_asked_for(
    url: str, tmp_path: Path
) -> None:
    """resume_run=<id> in a ServerApp's own start(), or resume-run in a run config."""
    from flplatform.core.errors import ConfigError
    from flplatform.run.run_record import LedgerRun

    run_id = record_run(url, tmp_path, config=simulate_config("t8"), tag="t8", rounds=2)
    with LedgerRepository.open(url) as repo:
        repo.add_event(run_id, DEPLOYED_EVENT, {"sites": ["london"], "address": "x:1"})
    with pytest.raises(ConfigError, match="trained on the sites of a deployment"):
        LedgerRun.reopen(url, run_id, strategy="local-sgd", num_rounds=4)
    with LedgerRepository.open(url) as repo:
        assert [e.kind for e in repo.list_events(run_id)] == [DEPLOYED_EVENT]


def test_a_deployment_reopens_its_own_runs_only(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``flplatform server`` marks its processes with (``DEPLOYMENT_ENV``): there, a
    deployed run resumes (on its sites), and a simulated one does not."""
    from flplatform.core.errors import ConfigError
    from flplatform.run.run_record import DEPLOYMENT_ENV, LedgerRun

    deployed = record_run(url, tmp_path, config=simulate_config("t6"), tag="t6", rounds=2)
    simulated = record_run(url, tmp_path, config=simulate_config("t5"), tag="t5", rounds=2)
    with LedgerRepository.open(url) as repo:
        repo.add_event(deployed, DEPLOYED_EVENT, {"sites": ["london"], "address": "x:1"})
    here = {"sites": ["london"], "address": "x:1", "deployment": "ca-0123456789ab"}
    monkeypatch.setenv(DEPLOYMENT_ENV, json.dumps(here))

    with pytest.raises(ConfigError) as refused:
        LedgerRun.reopen(url, simulated, strategy="local-sgd", num_rounds=4)
    assert str(refused.value) == (
        f"run {simulated} did not train on a deployment's sites (a simulation on the machine "
        f"that started it): resume it there with `flplatform resume {simulated}`"
    )
    reopened = LedgerRun.reopen(url, deployed, strategy="local-sgd", num_rounds=4)
    reopened.repository.close()
    assert (reopened.run_id, reopened.run_key) == (deployed, "t6")
    assert reopened.resume_state is not None and reopened.resume_state["server_round"] == 2
    with LedgerRepository.open(url) as repo:  # on this deployment's sites again, said so
        events = [(e.kind, e.detail) for e in repo.list_events(deployed)]
        assert [kind for kind, _ in events].count(DEPLOYED_EVENT) == 2
        assert events[-1] == (DEPLOYED_EVENT, here)
    with LedgerRepository.open(url) as repo:  # resumed on another CA's deployment since
        repo.add_event(deployed, DEPLOYED_EVENT, {"sites": ["london"], "deployment": "ca-1"})
    with pytest.raises(ConfigError, match=r"trained on another deployment \(ca-1; this one"):
        LedgerRun.reopen(url, deployed, strategy="local-sgd", num_rounds=4)


def test_the_deployment_marker_is_never_inherited(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only flplatform server's own processes carry it: a shell that exported it does not
    make a simulation's ServerApp resume a deployed run."""
    from flplatform.launch.flower import flower_environment
    from flplatform.run.run_record import DEPLOYMENT_ENV

    monkeypatch.setenv(DEPLOYMENT_ENV, json.dumps({"deployment": "ca-0123456789ab"}))
    assert DEPLOYMENT_ENV not in flower_environment(tmp_path)


def test_a_run_on_a_deployment_is_never_in_the_ledger_unmarked(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ServerApp records the ``deployed`` event with the run's own row (one
    transaction): a server killed a moment after the run began still leaves a run that
    only `flplatform server --resume` will resume, on its sites."""
    from flplatform.core.errors import ConfigError
    from flplatform.run.run_record import DEPLOYMENT_ENV, LedgerRun

    here = {"sites": ["london", "ohio"], "address": "x:1", "deployment": "ca-0123456789ab"}
    monkeypatch.setenv(DEPLOYMENT_ENV, json.dumps(here))
    run = LedgerRun.open(url, name="n", strategy="local-sgd", seed=0, config={}, num_rounds=3)
    run.repository.close()
    with LedgerRepository.open(url) as repo:
        record = repo.get_run(run.run_id)
        [event] = repo.list_events(run.run_id)
        assert (event.kind, event.detail, event.at) == (DEPLOYED_EVENT, here, record.created_at)
    monkeypatch.delenv(DEPLOYMENT_ENV)
    with pytest.raises(ConfigError, match=r"trained on the sites of a deployment \(london, ohio"):
        LedgerRun.reopen(url, run.run_id, strategy="local-sgd", num_rounds=3)
    # a run outside a deployment has no such event; a marker that is not the server's JSON
    # is refused before anything is recorded
    plain = LedgerRun.open(url, name="p", strategy="local-sgd", seed=0, config={}, num_rounds=3)
    plain.repository.close()
    monkeypatch.setenv(DEPLOYMENT_ENV, "ca-0123456789ab")
    with pytest.raises(ConfigError, match="FLPLATFORM_DEPLOYMENT must be the JSON"):
        LedgerRun.open(url, name="q", strategy="local-sgd", seed=0, config={}, num_rounds=3)
    with LedgerRepository.open(url) as repo:
        assert repo.list_events(plain.run_id) == []
        assert sorted(r.name for r in repo.list_runs()) == ["n", "p"]


def test_a_finished_run_is_refused(url: str, tmp_path: Path) -> None:
    run_id = record_run(
        url, tmp_path, config=simulate_config("t1"), tag="t1", rounds=4, status="finished"
    )

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    assert "finished; there is nothing to resume" in one_error_line(result.output)


def test_a_run_without_a_checkpoint_is_refused_with_what_to_do(url: str, tmp_path: Path) -> None:
    run_id = record_run(
        url, tmp_path, config=simulate_config("t2"), tag="t2", rounds=0, status="failed"
    )

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code != 0
    assert "has no checkpoint" in one_error_line(result.output)
    assert "start it again" in result.output


def test_a_run_whose_process_is_alive_is_refused_unless_forced(url: str, tmp_path: Path) -> None:
    # This test's own process plays the run's ServerApp, alive on this machine.
    run_id = record_run(
        url, tmp_path, config=simulate_config("t3"), tag="t3", rounds=2, owner=process_owner()
    )

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert f"process {process_owner()}, which is alive" in line
    assert "--force" in line
    with LedgerRepository.open(url) as repo:
        assert repo.list_events(run_id) == []  # refused before anything changed


def test_a_run_of_an_own_serverapp_is_refused_with_how_to_resume_it(
    url: str, tmp_path: Path
) -> None:
    # Started by the user's own code (no `flplatform run` launch recorded).
    run_id = record_run(
        url, tmp_path, config={"num-server-rounds": 4}, tag="t4", rounds=2, status="failed"
    )

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    assert "resume_run=" in one_error_line(result.output)


def test_a_flplatform_run_whose_app_directory_is_gone_is_refused_in_one_line(
    url: str, tmp_path: Path
) -> None:
    launch = {"app": str(tmp_path / "moved-away"), "cwd": str(tmp_path), "options": {"rounds": 4}}
    config = {"num-server-rounds": 4, LAUNCH_KEY: launch}
    run_id = record_run(url, tmp_path, config=config, tag="t5", rounds=2, status="failed")

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    assert "moved-away does not exist" in one_error_line(result.output)
    with LedgerRepository.open(url) as repo:
        assert repo.list_events(run_id) == []  # refused before the run was reopened
        assert repo.get_run(run_id).status == "failed"


@pytest.mark.parametrize(
    ("launch", "says"),
    [
        ({"options": {}}, "names no app directory"),
        ({"app": "x", "options": {"rocket": 1}}, "does not know: ['rocket']"),
        ({"app": "x", "options": {"rounds": "four"}}, "option 'rounds' has a value of the wrong"),
        ({"app": "x", "options": {"sites": [1, 2]}}, "option 'sites' has a value of the wrong"),
    ],
)
def test_a_malformed_recorded_launch_is_one_line(
    url: str, tmp_path: Path, launch: dict[str, Any], says: str
) -> None:
    config = {"num-server-rounds": 4, LAUNCH_KEY: launch}
    run_id = record_run(url, tmp_path, config=config, tag="t6", rounds=2, status="failed")

    result = invoke(["resume", str(run_id), "--db", url])

    assert result.exit_code == 2
    assert says in one_error_line(result.output)


def test_an_unknown_run_and_a_missing_ledger_are_one_line(url: str, tmp_path: Path) -> None:
    record_run(url, tmp_path, config=simulate_config("t5"), tag="t5", rounds=1)

    unknown = invoke(["resume", "99", "--db", url])
    missing = invoke(["resume", "1", "--db", f"sqlite:///{tmp_path / 'nothing.db'}"])

    assert unknown.exit_code == 5 and "99" in one_error_line(unknown.output)
    assert missing.exit_code != 0 and one_error_line(missing.output)
    assert not (tmp_path / "nothing.db").exists()


def test_the_dead_owner_check_reads_the_process_table() -> None:
    from flplatform.run.ledger import owner_alive

    host = process_owner().rpartition(":")[0]
    assert owner_alive(process_owner()) is True
    dead = 2**22 + 12345  # above Linux's default pid_max
    assert owner_alive(f"{host}:{dead}") is False
    assert owner_alive(f"another-host:{os.getpid()}") is None
    assert owner_alive(None) is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_killed_owner_not_yet_reaped_is_dead() -> None:
    """Where nothing reaps orphans (a container's PID 1), a killed run's server process stays
    a zombie: signal 0 reaches it, yet resume must not call it alive (CI hit this)."""
    from flplatform.run.ledger import owner_alive

    host = process_owner().rpartition(":")[0]
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the zombie still answers signal 0
        assert owner_alive(f"{host}:{child.pid}") is False
    finally:
        child.wait()
    assert owner_alive(f"{host}:{child.pid}") is False


def test_a_missing_proc_entry_is_reaped_for_our_own_processes_hidden_for_others() -> None:
    """Under /proc's hidepid another user's live process has no entry while signal 0 says
    it is there (PermissionError): it must not pass for dead."""
    from flplatform.core.processes import _ended

    gone = 2**22 + 4321  # above Linux's default pid_max
    assert _ended(gone, missing_means_ended=False) is False
    assert _ended(gone, missing_means_ended=True) is Path("/proc/self/stat").exists()


@pytest.mark.parametrize(
    "recorded", ["", "<not a database URL: removed>", "sqlite:///elsewhere.db"]
)
def test_a_resumed_run_writes_to_the_ledger_it_was_read_from(
    url: str, tmp_path: Path, recorded: str
) -> None:
    """Whatever its options recorded: the default ledger's runs recorded "" and migration
    0007 made that "<not a database URL: removed>", which a resume without --db kept, and
    a ledger file moved since names another place."""
    from flplatform.cli.resume import resumable_config

    config = {**simulate_config("t7"), "db": recorded}
    run_id = record_run(url, tmp_path, config=config, tag="t7", rounds=2)
    with LedgerRepository.open(url) as repo:
        record = repo.get_run(run_id)
    assert resumable_config(record, db="", round_timeout=None).db == ""
    assert resumable_config(record, db=url, round_timeout=None).db == url
