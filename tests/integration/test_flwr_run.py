"""`flwr run .` runs the same federations through Flower's own CLI: every strategy, in one
sweep (one start-up)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flplatform.launch.flower import flower_environment, free_port
from storage import LedgerRepository

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _stop_local_superlink(port: int) -> None:
    """`flwr run` leaves the local SuperLink it started running; stop ours."""
    found = subprocess.run(
        ["pgrep", "-f", f"flower-superlink.*--port {port}"], capture_output=True, text=True
    )
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid), signal.SIGTERM)


# The three strategies as one sweep (the run config's `sweep` key, a JSON list of each
# run's options beyond the base): one Flower start-up, each run its own in the ledger.
MEMBERS = {
    # DiLoCo's outer step and int4 uploads: options of the app's own run config
    "local-sgd": {
        "num-server-rounds": 2,
        "server-nesterov": True,
        "server-momentum": 0.9,
        "server-lr": 0.7,
        "codec": "int4",
    },
    "delayed": {"num-server-rounds": 2},
    "sketched-sgd": {"num-server-rounds": 4, "k": 500},
}


def test_flwr_run_dot_trains_and_writes_the_ledger(flplatform_home: Path) -> None:
    env = flower_environment(flplatform_home)
    http_port, control_port = free_port(), free_port()
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(http_port)
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control_port)
    flwr = str(Path(sys.executable).parent / "flwr")
    sweep = json.dumps([{"strategy": name, **options} for name, options in MEMBERS.items()])
    try:
        done = subprocess.run(
            [
                flwr,
                "run",
                ".",
                "--stream",
                "--run-config",
                f"local-epochs=1 sites='a,b,c' sweep='{sweep}'",
                "--federation-config",
                "num-supernodes=3 init-args-num-cpus=2",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        _stop_local_superlink(http_port)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The ServerApp inherited FLPLATFORM_HOME, so the default ledger is in our home.
    with LedgerRepository.open(f"sqlite:///{flplatform_home / 'ledger.db'}") as repo:
        listed = repo.list_runs()
        runs = {run.config["strategy"]: run for run in listed}
        assert len(listed) == len(MEMBERS) and sorted(runs) == sorted(MEMBERS)
        for strategy, run in runs.items():
            assert run.status == "finished", (strategy, run.error)
            assert [s.name for s in repo.list_sites(run.id)] == ["a", "b", "c"]
            rounds = repo.list_rounds(run.id)
            assert rounds[-1].metrics["accuracy"] > 0.3, strategy
            if strategy == "local-sgd":
                assert [r.num_applied for r in rounds] == [3, 3]  # int4 uploads decoded
                assert (run.config["server-nesterov"], run.config["codec"]) == (True, "int4")
                # 4.5 bits an element, and the model dense down: fewer bytes up than down
                assert sum(r.bytes_up for r in rounds) < 0.5 * sum(r.bytes_down for r in rounds)
            elif strategy == "sketched-sgd":  # a sketch round, then a values round, per step
                assert [(r.model_version, r.num_applied) for r in rounds] == [
                    (0, 3),
                    (1, 3),
                    (1, 3),
                    (2, 3),
                ]
            else:  # a site may land its period-2 update while round 1 is still open
                updates = repo.list_updates(run.id)
                assert sorted(u.period for u in updates) == [1, 1, 1, 2, 2, 2]
                assert all(u.status == "applied" for u in updates)
    # Runtime dependency installation stayed off: no per-run environment was synced.
    assert "uv sync" not in done.stdout + done.stderr
