"""Resume after SIGKILL, for real: ``flplatform simulate`` killed at committed rounds, then
``flplatform resume``, ends with the same global model, bit for bit, and the same ledger
rows (wall times and measured durations aside) as the same seeded run left alone.

Real Flower simulations on the virtual clock. A kill takes the whole command down at once
(its process and every process below it, SIGKILL: what a machine that restarts does), right
after the ledger shows the round it was aimed at; the next resume is killed the same way at a
later round, and the last one runs to the end. The sites die with everything else: they
find their state in their snapshots on disk (``strategies/mods/contract.py``).

One case in the default suite; every strategy and mode with ``make test-resume``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from flplatform.ledger_rows import Kind, UpdateColumns, columns
from storage import LedgerRepository
from tests.integration.test_lifecycle import Leftovers

ROOT = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 300.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc (Linux)"),
]

BASE = [
    "--sites",
    "3",
    "--dataset",
    "digits",
    "--local-steps",
    "3",
    "--network",
    "world",
    "--compute-model",
    "exponential",
    "--seed",
    "7",
]
ROUNDS = 7
# (id, options, kill after these committed rounds, in the default suite)
CASES = [
    ("local-sgd-momentum-sync", ["--server-momentum", "0.9"], (2, 4, 5), False),
    (
        "local-sgd-momentum-topk-k-async",
        ["--server-momentum", "0.9", "--sync", "k-async", "--k", "2", "--codec", "topk:0.1"],
        (2, 4, 5),
        True,
    ),
    ("delayed-d2", ["--strategy", "delayed", "--delay", "2"], (2, 3, 5), False),
    (
        "fetchsgd",
        ["--strategy", "fetchsgd", "--k", "200", "--sketch-momentum", "0.9"],
        (1, 3, 5),
        False,
    ),
    (
        "sketched-sgd",
        ["--strategy", "sketched-sgd", "--k", "200", "--step-momentum", "0.9"],
        (2, 3, 5),
        False,
    ),
]


def _cli(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", "from flplatform.cli.app import main; main()", *args],
        env=env,
        cwd=cwd,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def _kill_after(cli: subprocess.Popen[bytes], db: str, run_id: int | None, rounds: int) -> int:
    """SIGKILL the command and everything below it once the run has ``rounds`` rounds."""
    leftovers = Leftovers(cli.pid)
    deadline = time.monotonic() + STARTUP_SECONDS
    with LedgerRepository.open(db) as repository:
        while True:
            leftovers.record()
            runs = repository.list_runs()
            run = next((r for r in runs if run_id is None or r.id == run_id), None)
            if run is not None and run.rounds_completed >= rounds:
                break
            assert cli.poll() is None, "the command ended before the kill"
            assert time.monotonic() < deadline, "the round did not come"
            time.sleep(0.05)
    cli.kill()
    for line in leftovers.alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    cli.wait()
    time.sleep(1.0)
    assert leftovers.alive() == []
    return run.id


def _wait(cli: subprocess.Popen[bytes], log: Path) -> None:
    code = cli.wait(timeout=STARTUP_SECONDS * 3)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "Traceback" not in text


def _model(db: str, run_id: int, out: Path, cwd: Path, log: Path) -> dict[str, torch.Tensor]:
    cli = _cli(["export", str(run_id), "--db", db, "--out", str(out)], cwd, log)
    _wait(cli, log)
    return torch.load(out, weights_only=True)


def _rows(db: str, run_id: int) -> tuple[list, list]:
    """The run's rounds and updates without wall times, measured durations or row ids."""
    skip = {"id", "run_id", "site_id", "started_at", "finished_at", "wall_seconds"}
    skip |= {f.name for f, c in columns(UpdateColumns) if c.kind in (Kind.WALL_TIME, Kind.DURATION)}
    with LedgerRepository.open(db) as repository:
        rounds = [
            {f.name: getattr(r, f.name) for f in fields(r) if f.name not in skip}
            for r in repository.list_rounds(run_id)
        ]
        updates = [
            {f.name: getattr(u, f.name) for f in fields(u) if f.name not in skip}
            for u in repository.list_updates(run_id)
        ]
    key = lambda u: (u["round"], u["site"], u.get("model_version"), u["status"])  # noqa: E731
    return rounds, sorted(updates, key=lambda u: repr(key(u)))


@pytest.mark.parametrize(
    "options,kills",
    [
        pytest.param(o, k, id=name, marks=() if default else pytest.mark.resume)
        for name, o, k, default in CASES
    ],
)
@pytest.mark.usefixtures("flplatform_home")
def test_a_run_killed_and_resumed_ends_bit_for_bit_as_the_uninterrupted_run(
    tmp_path: Path, options: list[str], kills: tuple[int, ...]
) -> None:
    log = tmp_path / "output.txt"
    args = ["simulate", *BASE, *options, "--rounds", str(ROUNDS)]
    reference_db = f"sqlite:///{tmp_path / 'reference.db'}"
    _wait(_cli([*args, "--db", reference_db], tmp_path, log), log)

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    LedgerRepository.open(db).close()  # created first, so that both processes find it
    run_id = _kill_after(_cli([*args, "--db", db], tmp_path, log), db, None, kills[0])
    for rounds in kills[1:]:
        cli = _cli(["resume", str(run_id), "--db", db], tmp_path, log)
        _kill_after(cli, db, run_id, rounds)
    _wait(_cli(["resume", str(run_id), "--db", db], tmp_path, log), log)

    with LedgerRepository.open(reference_db) as repository:
        [reference] = repository.list_runs()
    resumed_model = _model(db, run_id, tmp_path / "resumed.pt", tmp_path, log)
    reference_model = _model(reference_db, reference.id, tmp_path / "reference.pt", tmp_path, log)
    assert list(resumed_model) == list(reference_model)
    for name, tensor in reference_model.items():
        assert torch.equal(resumed_model[name], tensor), name
    assert np.isfinite(sum(float(t.float().sum()) for t in reference_model.values()))

    assert _rows(db, run_id) == _rows(reference_db, reference.id)
    with LedgerRepository.open(db) as repository:
        run = repository.get_run(run_id)
        events = repository.list_events(run_id)
    assert run.status == "finished"
    assert sum(e.kind == "resumed" for e in events) == len(kills)
