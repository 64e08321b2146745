"""A simulation is reachable from this machine only: every process it starts (SuperLink,
SuperExec, flwr-simulation, Ray's gcs_server, raylet and agents, the ClientApp actors)
listens on loopback.

A real simulation; its listening sockets are read from ``/proc`` as it runs, the way
``ss -ltunp`` finds them.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from flplatform.config import RunConfig
from flplatform.processes import ListeningSocket, ProcessTree, listening_sockets
from flplatform.simulation import start_simulation, work_home
from storage import LedgerRepository

STARTUP_SECONDS = 240.0  # Flower and Ray starting on a busy 2-core machine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads sockets from /proc (Linux)"),
]


@pytest.mark.usefixtures("flplatform_home")
def test_every_process_of_a_simulation_listens_on_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Ray instance named in the environment is not joined: the simulation starts its own.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    tag = uuid.uuid4().hex
    config = RunConfig.from_mapping(
        {"sites": "a,b", "num-server-rounds": 2, "local-steps": 2, "db": db, "run-tag": tag}
    )
    seen: set[ListeningSocket] = set()
    with ProcessTree() as tree:
        process = start_simulation(config, home=work_home(), log_name=tag[:12], tree=tree)
        deadline = time.monotonic() + STARTUP_SECONDS
        while process.poll() is None:
            assert time.monotonic() < deadline, "the simulation did not end in time"
            tree.record()
            seen.update(listening_sockets(tree.alive()))
            time.sleep(0.1)
        assert process.poll() == 0, process.log_tail()
        superlink = process.superlink.pid

    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
    assert (run.status, run.rounds_completed) == ("finished", 2)  # the sites trained
    # The scan saw the processes that listen: the SuperLink, Ray's own and the actors'.
    commands = {s.command for s in seen}
    assert any(s.pid == superlink for s in seen), sorted(map(str, seen))
    assert {"gcs_server", "raylet"} <= commands, sorted(map(str, seen))
    assert any(c.startswith("ray::ClientApp") for c in commands), sorted(map(str, seen))
    print("\n".join(sorted(map(str, seen))))
    assert sorted(str(s) for s in seen if not s.loopback) == []
