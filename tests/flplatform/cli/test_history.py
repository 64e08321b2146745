"""`flplatform history runs|rounds|sites` on a ledger written through the repository."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli import history as history_command
from flplatform.cli.app import app
from flplatform.cli.history import human_seconds, staleness_counts
from storage import LedgerRepository, UpdateInput, UpdateStatus

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


@pytest.fixture
def simulated_ledger(tmp_path: Path) -> str:
    """A run on the 'mobile' network: two rounds with virtual times, one site stale once."""
    url = f"sqlite:///{tmp_path / 'simulated.db'}"
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="fedbuff-digits",
            strategy="fedbuff",
            seed=3,
            config={},
            num_rounds_planned=2,
            network="mobile",
        )
        for name in ("london", "tokyo"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        for rnd in (1, 2):
            # Simulated: each round takes 10 s; london's replies take 8 s, tokyo's 9 s, so
            # london waits 2 s and tokyo 1 s for their second dispatch at 10 s.
            start = 10.0 * (rnd - 1)
            repo.record_round(
                run_id,
                round=rnd,
                model_version=rnd,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={"accuracy": 0.5},
                train_loss=0.5,
                virtual_started_at=start,
                virtual_finished_at=start + 10.0,
                updates=[
                    UpdateInput(
                        site=name,
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=rnd - 1 if name == "london" else 0,
                        bytes_up=1000,
                        bytes_down=1000,
                        status="applied",
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.4,
                        virtual_dispatched_at=start,
                        virtual_arrived_at=start + busy,
                        virtual_compute_seconds=busy - 3.0,
                        transfer_seconds=3.0,
                    )
                    for name, busy in (("london", 8.0), ("tokyo", 9.0))
                ],
            )
        repo.finish_run(run_id, status="finished", simulated_seconds=3725.0)
    return url


def history(*args: str) -> str:
    result = runner.invoke(app, ["history", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_runs_show_the_network_and_simulated_time(simulated_ledger: str, ledger: str) -> None:
    table = history("runs", "--db", simulated_ledger)
    assert "network" in table and "simulated" in table
    assert "mobile" in table and "1h 02m 05s" in table

    [row] = json.loads(history("runs", "--db", simulated_ledger, "--format", "json"))
    assert (row["network"], row["simulated_seconds"]) == ("mobile", 3725.0)
    [wall] = json.loads(history("runs", "--db", ledger, "--format", "json"))
    assert (wall["network"], wall["simulated_seconds"]) == (None, None)
    (record,) = csv.DictReader(io.StringIO(history("runs", "--db", ledger, "--format", "csv")))
    assert (record["network"], record["simulated_seconds"]) == ("", "")


def test_rounds_show_simulated_time_only_for_simulated_runs(
    simulated_ledger: str, ledger: str
) -> None:
    table = history("rounds", "latest", "--db", simulated_ledger)
    assert "sim s" in table and "20.0" in table
    assert "sim s" not in history("rounds", "latest", "--db", ledger)

    rows = json.loads(history("rounds", "1", "--db", simulated_ledger, "--format", "json"))
    assert [(r["virtual_started_at"], r["virtual_finished_at"]) for r in rows] == [
        (0.0, 10.0),
        (10.0, 20.0),
    ]
    rows = json.loads(history("rounds", "1", "--db", ledger, "--format", "json"))
    assert {r["virtual_finished_at"] for r in rows} == {None}


def test_sites_show_staleness_distribution_and_waiting(simulated_ledger: str, ledger: str) -> None:
    table = history("sites", "1", "--db", simulated_ledger)
    assert "staleness" in table and "counts" in table and "p90" in table
    assert "0:1 1:1" in table and "0:2" in table
    assert "waiting s" in table and "(virtual)" in table

    rows = {
        r["name"]: r
        for r in json.loads(history("sites", "1", "--db", simulated_ledger, "-f", "json"))
    }
    london, tokyo = rows["london"], rows["tokyo"]
    assert london["staleness_counts"] == [[0, 1], [1, 1]]
    assert (london["p90_staleness"], london["max_staleness"]) == (1, 1)
    assert (london["waiting_seconds"], london["busy_seconds"]) == (2.0, 16.0)
    assert (tokyo["waiting_seconds"], tokyo["busy_seconds"]) == (1.0, 18.0)
    assert london["waiting_clock"] == "virtual"
    assert (london["virtual_compute_seconds"], london["transfer_seconds"]) == (10.0, 6.0)

    out = history("sites", "1", "--db", simulated_ledger, "--format", "csv")
    by_name = {r["name"]: r for r in csv.DictReader(io.StringIO(out))}
    assert json.loads(by_name["tokyo"]["staleness_counts"]) == [[0, 2]]
    assert (by_name["tokyo"]["waiting_clock"], by_name["tokyo"]["waiting_seconds"]) == (
        "virtual",
        "1.0",
    )

    wall = history("sites", "1", "--db", ledger)
    assert "(wall)" in wall and "0:2" in wall
    rows = {r["name"]: r for r in json.loads(history("sites", "1", "--db", ledger, "-f", "json"))}
    # tokyo's second update was rejected: only the applied one counts for staleness.
    assert rows["tokyo"]["staleness_counts"] == [[0, 1]]
    assert rows["london"]["waiting_clock"] == "wall"
    assert rows["london"]["waiting_seconds"] == pytest.approx(0.6, abs=1e-5)  # 1.4 s -> 2 s


@pytest.fixture
def delayed_ledger(tmp_path: Path) -> str:
    """A delayed run: london applies with delays 0 then 1; tokyo's only delayed update is
    rejected, so it has no mean delay; paris applies without delay fields."""
    url = f"sqlite:///{tmp_path / 'delayed.db'}"
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="delayed-digits", strategy="delayed", seed=3, config={}, num_rounds_planned=2
        )
        for name in ("london", "tokyo", "paris"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        # (site, status, period, average_applied, delay) per round; delay = period - 1 - average.
        plan: dict[int, list[tuple[str, UpdateStatus, int | None, int | None, int | None]]] = {
            1: [("london", "applied", 1, 0, 0), ("tokyo", "applied", None, None, None)],
            2: [
                ("london", "applied", 3, 1, 1),
                ("tokyo", "rejected", 3, 0, 2),
                ("paris", "applied", None, None, None),
            ],
        }
        for rnd, rows in plan.items():
            repo.record_round(
                run_id,
                round=rnd,
                model_version=rnd,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={"accuracy": 0.5},
                train_loss=0.5,
                updates=[
                    UpdateInput(
                        site=site,
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=0,
                        bytes_up=1000,
                        bytes_down=1000,
                        status=status,
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.4,
                        period=period,
                        average_applied=average,
                        delay=delay,
                    )
                    for site, status, period, average, delay in rows
                ],
            )
        repo.finish_run(run_id, status="finished")
    return url


def _table(output: str) -> tuple[list[str], dict[str, list[str]]]:
    """A rich table's header (each column's wrapped header lines joined) and its body rows,
    keyed by their first cell."""
    header: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in output.splitlines():
        if line.startswith("┃"):
            parts = [part.strip() for part in line.split("┃")[1:-1]]
            header = [
                " ".join(filter(None, pair))
                for pair in zip(header or [""] * len(parts), parts, strict=True)
            ]
        elif line.startswith("│"):
            cells = [cell.strip() for cell in line.split("│")[1:-1]]
            rows[cells[0]] = cells
    return header, rows


def test_sites_show_a_delay_column_only_for_delayed_runs(
    delayed_ledger: str, ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wide enough that no header or cell is cut short, whatever terminal runs the tests.
    monkeypatch.setattr(history_command.console, "width", 220)
    header, rows = _table(history("sites", "1", "--db", delayed_ledger))
    assert header[:2] == ["site", "examples"]
    at = header.index("delay")
    # london: (0 + 1) / 2; tokyo's delayed update was rejected; paris had no delays.
    assert (rows["london"][at], rows["tokyo"][at], rows["paris"][at]) == ("0.50", "-", "-")

    by_name = {
        r["name"]: r
        for r in json.loads(history("sites", "1", "--db", delayed_ledger, "-f", "json"))
    }
    assert [by_name[n]["mean_delay"] for n in ("london", "tokyo", "paris")] == [0.5, None, None]
    out = history("sites", "1", "--db", delayed_ledger, "--format", "csv")
    csv_rows = {r["name"]: r for r in csv.DictReader(io.StringIO(out))}
    assert (csv_rows["london"]["mean_delay"], csv_rows["paris"]["mean_delay"]) == ("0.5", "")

    # A run without delays looks as before: no column, but JSON still carries the field.
    header, rows = _table(history("sites", "1", "--db", ledger))
    assert "delay" not in header and len(rows["london"]) == len(header)
    assert {
        r["mean_delay"] for r in json.loads(history("sites", "1", "--db", ledger, "-f", "json"))
    } == {None}


def test_table_cells_for_durations_and_staleness() -> None:
    assert [human_seconds(s) for s in (None, 0.0, 42.54, 65.0, 3725.0)] == [
        "-",
        "0.0 s",
        "42.5 s",
        "1m 05s",
        "1h 02m 05s",
    ]
    assert staleness_counts({}) == "-"
    assert staleness_counts({2: 1, 0: 12, 1: 5}) == "0:12 1:5 2:1"
    assert staleness_counts({k: 1 for k in range(10)}, limit=3) == "0:1 1:1 2:1 (+7 more)"


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
