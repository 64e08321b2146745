"""`flplatform history runs|rounds|sites` on a ledger written through the repository."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from storage import LedgerRepository, UpdateInput

runner = CliRunner()


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    """A run with two sites and two rounds, one update rejected."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="local-sgd-digits",
            strategy="local-sgd",
            seed=3,
            config={"lr": 0.1},
            num_rounds_planned=2,
        )
        repo.add_site(run_id, name="london", node_id=11, partition_id=0, num_examples=100)
        repo.add_site(run_id, name="tokyo", node_id=2**64 - 1, partition_id=1, num_examples=50)
        for rnd in (1, 2):
            repo.record_round(
                run_id,
                round=rnd,
                model_version=rnd,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={"accuracy": 0.5 + 0.2 * rnd, "loss": 1.0 / rnd},
                train_loss=0.9 / rnd,
                updates=[
                    UpdateInput(
                        site="london",
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=0,
                        bytes_up=1000,
                        bytes_down=1100,
                        status="applied",
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.4,
                        num_examples=100,
                        train_loss=0.8,
                        compute_seconds=0.2,
                    ),
                    UpdateInput(
                        site="tokyo",
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=0,
                        bytes_up=900,
                        bytes_down=1100,
                        status="rejected" if rnd == 2 else "applied",
                        reason="array 'w' contains NaN or Inf" if rnd == 2 else None,
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.3,
                        num_examples=50,
                    ),
                ],
            )
        repo.finish_run(run_id, status="finished", final_metrics={"accuracy": 0.9})
    return url


def test_runs_table_json_csv(ledger: str) -> None:
    table = runner.invoke(app, ["history", "runs", "--db", ledger])
    assert table.exit_code == 0, table.output
    assert (
        "local-sgd-digits" in table.output and "finished" in table.output and "2/2" in table.output
    )

    rows = json.loads(
        runner.invoke(app, ["history", "runs", "--db", ledger, "--format", "json"]).output
    )
    assert rows[0]["status"] == "finished"
    assert rows[0]["final_metrics"] == {"accuracy": 0.9}

    out = runner.invoke(app, ["history", "runs", "--db", ledger, "--format", "csv"]).output
    (record,) = list(csv.DictReader(io.StringIO(out)))
    assert record["strategy"] == "local-sgd" and record["seed"] == "3"


def test_rounds_show_bytes_and_outcomes(ledger: str) -> None:
    rows = json.loads(
        runner.invoke(app, ["history", "rounds", "1", "--db", ledger, "--format", "json"]).output
    )
    assert [r["round"] for r in rows] == [1, 2]
    assert [r["num_rejected"] for r in rows] == [0, 1]
    assert rows[0]["bytes_up"] == 1900 and rows[0]["bytes_down"] == 2200
    table = runner.invoke(app, ["history", "rounds", "latest", "--db", ledger]).output
    assert "1.9 KiB" in table and "2.1 KiB" in table


def test_sites_summarise_each_site(ledger: str) -> None:
    rows = json.loads(
        runner.invoke(app, ["history", "sites", "1", "--db", ledger, "--format", "json"]).output
    )
    by_name = {r["name"]: r for r in rows}
    assert by_name["london"]["applied"] == 2 and by_name["london"]["bytes_up"] == 2000
    assert by_name["tokyo"]["rejected"] == 1 and by_name["tokyo"]["node_id"] == 2**64 - 1


def test_missing_run_is_one_line(ledger: str) -> None:
    result = runner.invoke(app, ["history", "rounds", "42", "--db", ledger])
    assert result.exit_code == 5
    assert "run 42 does not exist" in result.output
    bad = runner.invoke(app, ["history", "sites", "abc", "--db", ledger])
    assert bad.exit_code == 2 and "RUN must be a run id" in bad.output


def test_data_split_writes_one_file_per_site(tmp_path: Path) -> None:
    out = tmp_path / "split"
    result = runner.invoke(
        app, ["data", "split", "--out", str(out), "--sites", "london,tokyo", "--alpha", "0.3"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "london.npz",
        "manifest.json",
        "test.npz",
        "tokyo.npz",
    ]
    again = runner.invoke(app, ["data", "split", "--out", str(out), "--sites", "london,tokyo"])
    assert again.exit_code != 0 and "overwrite" in again.output
