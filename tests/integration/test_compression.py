"""Compressed uploads and FetchSGD in real Flower simulations, through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.app.tracking import tensorboard_directory
from flplatform.cli.app import app
from storage import LedgerRepository

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("flplatform_home")]
runner = CliRunner()


def test_fetchsgd_uploads_sketches_and_downloads_changes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["simulate", "--strategy", "fetchsgd", "--k", "500", "--sketch-momentum", "0.9"]
    args += ["--rounds", "5", "--local-steps", "10", "--fraction-train", "0.5", "--db", db]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished" and run.config["strategy"] == "fetchsgd"
        rounds = repo.list_rounds(run.id)
        assert rounds[-1].metrics["accuracy"] > 0.3  # it learns (chance: 0.1)
        updates = repo.list_updates(run.id)
        assert len(updates) == 5 * 2 and all(u.status == "applied" for u in updates)
        table = 5 * 2500 * 4  # r × c float32, c = 5·k
        assert all(table < u.bytes_up < table + 4096 for u in updates)
        # First contacts carry the model; a site back after missing rounds only the
        # coordinates changed since (at most k per round).
        downs = sorted(u.bytes_down for u in updates)
        assert downs[0] < downs[-1] / 2


def test_local_sgd_with_top_k_uploads(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    # Both codecs in one Flower start-up: `simulate`'s sweep, as a user compares them.
    args = ["simulate", "--codec", "none,topk:0.05", "--rounds", "3", "--local-steps", "10"]
    result = runner.invoke(app, [*args, "--db", db, "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    assert "flplatform history compare" in result.output
    with LedgerRepository.open(db) as repo:
        dense, sparse = repo.list_runs()[::-1]
        up = {
            run.config["codec"]: sum(r.bytes_up for r in repo.list_rounds(run.id))
            for run in (dense, sparse)
        }
        assert up["topk:0.05"] < 0.2 * up["none"]
        assert repo.list_rounds(sparse.id)[-1].metrics["accuracy"] > 0.5
        # --tensorboard: each run of the sweep, written once the sweep ended
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for run in (dense, sparse):
            events = EventAccumulator(str(tensorboard_directory(tmp_path / "tb", run.id, run.name)))
            events.Reload()
            bytes_up = [(s.step, s.value) for s in events.Scalars("bytes_up")]
            assert bytes_up == [(r.round, r.bytes_up) for r in repo.list_rounds(run.id)]


def test_sketched_sgd_takes_two_rounds_per_step_on_a_simulated_network(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["simulate", "--strategy", "sketched-sgd", "--k", "500", "--step-momentum", "0.9"]
    args += ["--rounds", "8", "--local-steps", "10", "--network", "world", "--db", db]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished" and run.config["strategy"] == "sketched-sgd"
        rounds = repo.list_rounds(run.id)
        assert [r.model_version for r in rounds] == [0, 1, 1, 2, 2, 3, 3, 4]
        assert rounds[-1].metrics["accuracy"] > 0.5
        updates = repo.list_updates(run.id)
        assert len(updates) == 8 * 4 and all(u.status == "applied" for u in updates)
        table, values = 5 * 2500 * 4, 2 * 500 * 4  # r × c float32; P·k float32
        for number in range(1, 9):
            rows = [u for u in updates if u.round == number]
            if number % 2:  # sketch rounds train; values rounds only answer
                assert all(table < u.bytes_up < table + 4096 for u in rows)
                assert all(u.virtual_compute_seconds > 0 for u in rows)
            else:
                assert all(values < u.bytes_up < values + 4096 for u in rows)
                assert all(values < u.bytes_down < values + 4096 for u in rows)
                assert all(u.virtual_compute_seconds == 0 for u in rows)
