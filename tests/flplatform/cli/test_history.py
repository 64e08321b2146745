"""`flplatform history runs|rounds|sites` on a ledger written through the repository."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from typer.testing import CliRunner

from flplatform.cli import history as history_command
from flplatform.cli.app import app
from flplatform.cli.history import (
    FAILED_STATUSES,
    common_reason,
    failure_note,
    human_seconds,
    staleness_counts,
)
from flplatform.core.errors import StorageError
from flplatform.engine.events import SITE_BACK_EVENT, SITE_LOST_EVENT, SITE_SILENT_EVENT
from storage import (
    RESUMED_EVENT,
    FinalRunStatus,
    LedgerRepository,
    RunRecord,
    TrafficInput,
    UpdateInput,
    UpdateRecord,
    UpdateStatus,
)
from storage.migrations import alembic_config, current_revisions, head_revision
from storage.session import create_ledger_engine
from tests.helpers.cli import read_table
from tests.helpers.ledger_records import make_run, record, update

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """A console wide enough for every column and cell, whatever runs the tests (tables at
    100 columns are tested in test_table_widths.py)."""
    monkeypatch.setattr(history_command.console, "width", 400)


@pytest.fixture
def ledger(sqlite_ledger: str) -> str:
    """A run with two sites and two rounds, one update rejected."""
    url = sqlite_ledger
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
        repo.add_traffic(
            run_id,
            [
                TrafficInput(site="london", kind="query", messages=1, bytes_up=300, bytes_down=400),
                TrafficInput(site="tokyo", kind="query", messages=1, bytes_up=310, bytes_down=400),
            ],
        )
        late = TrafficInput(site="tokyo", kind="evaluate", messages=0, bytes_up=90, bytes_down=10)
        repo.add_traffic(run_id, [late], round=2)
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
    # Every byte of the run: its updates, then its queries and the late reply.
    assert rows[0]["bytes_up"] == 2 * (1000 + 900) + 300 + 310 + 90
    assert rows[0]["bytes_down"] == 2 * 2200 + 400 + 400 + 10

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
    tokyo = by_name["tokyo"]
    assert (tokyo["queries"], tokyo["query_bytes_up"], tokyo["query_bytes_down"]) == (1, 310, 400)
    assert (tokyo["total_bytes_up"], tokyo["total_bytes_down"]) == (1800 + 310 + 90, 2610)


def test_traffic_lists_what_no_update_holds_then_the_run_s_totals(ledger: str) -> None:
    result = runner.invoke(app, ["history", "traffic", "1", "--db", ledger])
    assert result.exit_code == 0, result.output
    assert "join" in result.output and "evaluate" in result.output
    assert "Run 1 in all (its updates, evaluations and traffic): 4.4 KiB up" in result.output
    rows = json.loads(
        runner.invoke(
            app, ["history", "traffic", "1", "--db", ledger, "--site", "tokyo", "-f", "json"]
        ).output
    )
    assert [(r["round"], r["kind"], r["messages"], r["bytes_up"]) for r in rows] == [
        (None, "query", 1, 310),
        (2, "evaluate", 0, 90),
    ]
    out = runner.invoke(
        app, ["history", "traffic", "1", "--db", ledger, "--kind", "query", "-f", "csv"]
    ).output
    assert [r["site"] for r in csv.DictReader(io.StringIO(out))] == ["london", "tokyo"]
    bad = runner.invoke(app, ["history", "traffic", "1", "--db", ledger, "--kind", "gossip"])
    assert bad.exit_code == 2
    assert "--kind must be one of train, evaluate, query, got 'gossip'" in bad.output
    missing = runner.invoke(app, ["history", "traffic", "1", "--db", ledger, "--site", "ohio"])
    assert missing.exit_code == 5 and "run 1 has no site 'ohio'" in missing.output


def test_missing_run_is_one_line(ledger: str) -> None:
    result = runner.invoke(app, ["history", "rounds", "42", "--db", ledger])
    assert result.exit_code == 5
    assert "run 42 does not exist" in result.output
    for spelled in ("abc", "1_0", "\u0661", " 1"):  # not another run's id ("1_0": 10)
        bad = runner.invoke(app, ["history", "sites", spelled, "--db", ledger])
        assert bad.exit_code == 2 and "RUN must be a run id" in bad.output, spelled


@pytest.fixture
def simulated_ledger(new_sqlite_ledger: Callable[[str], str]) -> str:
    """A run on the 'mobile' network: two rounds with virtual times, one site stale once."""
    url = new_sqlite_ledger("simulated.db")
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
    assert "(clock)" in table  # the clock's compute beside the sites' own

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
    assert "(clock)" not in wall
    rows = {r["name"]: r for r in json.loads(history("sites", "1", "--db", ledger, "-f", "json"))}
    # tokyo's second update was rejected: only the applied one counts for staleness.
    assert rows["tokyo"]["staleness_counts"] == [[0, 1]]
    assert rows["london"]["waiting_clock"] == "wall"
    assert rows["london"]["waiting_seconds"] == pytest.approx(0.6, abs=1e-5)  # 1.4 s -> 2 s


@pytest.fixture
def delayed_ledger(new_sqlite_ledger: Callable[[str], str]) -> str:
    """A delayed run: london applies with delays 0 then 1; tokyo's only delayed update is
    rejected, so it has no mean delay; paris applies without delay fields."""
    url = new_sqlite_ledger("delayed.db")
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


def test_sites_show_a_delay_column_only_for_delayed_runs(
    delayed_ledger: str, ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wide enough that no header or cell is cut short, whatever terminal runs the tests.
    monkeypatch.setattr(history_command.console, "width", 220)
    header, rows = read_table(history("sites", "1", "--db", delayed_ledger))
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
    header, rows = read_table(history("sites", "1", "--db", ledger))
    assert "delay" not in header and len(rows["london"]) == len(header)
    assert {
        r["mean_delay"] for r in json.loads(history("sites", "1", "--db", ledger, "-f", "json"))
    } == {None}


def test_updates_show_a_fragment_column_only_when_an_update_carried_one(
    new_sqlite_ledger: Callable[[str], str], ledger: str
) -> None:
    url = new_sqlite_ledger("streaming.db")
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="streaming", strategy="local-sgd", seed=3, config={}, num_rounds_planned=3
        )
        repo.add_site(run_id, name="london", node_id=1, num_examples=100)
        # One update a round: fragments 0 and 1, then one of the whole model.
        for rnd, fragment in ((1, 0), (2, 1), (3, None)):
            repo.record_round(
                run_id,
                round=rnd,
                model_version=rnd,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={},
                train_loss=0.5,
                updates=[
                    UpdateInput(
                        site="london",
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=0,
                        bytes_up=1000,
                        bytes_down=1000,
                        status="applied",
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.4,
                        fragment=fragment,
                    )
                ],
            )
    header, rows = read_table(history("updates", "1", "--db", url))
    at = header.index("fragment")
    assert [rows[r][at] for r in ("1", "2", "3")] == ["0", "1", "-"]
    assert [
        u["fragment"] for u in json.loads(history("updates", "1", "--db", url, "-f", "json"))
    ] == [
        0,
        1,
        None,
    ]

    # Updates of the whole model look as before: no column, but JSON still carries the field.
    header, _ = read_table(history("updates", "1", "--db", ledger))
    assert "fragment" not in header
    assert {
        u["fragment"] for u in json.loads(history("updates", "1", "--db", ledger, "-f", "json"))
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
    # the administrator is told to move the sites' files off the server
    said = " ".join(result.output.split())
    assert "Copy each <site>.npz to its site" in said and "delete it here" in said
    again = runner.invoke(app, ["data", "split", "--out", str(out), "--sites", "london,tokyo"])
    assert again.exit_code != 0 and "overwrite" in again.output


# ------------------------------------------------------------------ history updates
@pytest.fixture
def failing_ledger(new_sqlite_ledger: Callable[[str], str]) -> str:
    """Three rounds of two sites: round 1 applies both; in round 2 london's update is
    rejected (a reason quoting brackets) and tokyo's dropped; in round 3 both are rejected."""
    url = new_sqlite_ledger("failing.db")
    t0 = time.time()
    missing = "missing arrays: [conv1.weight] " + "x" * 200
    # (site, status, reason) per round
    plan: dict[int, list[tuple[str, UpdateStatus, str | None]]] = {
        1: [("london", "applied", None), ("tokyo", "applied", None)],
        2: [("london", "rejected", missing), ("tokyo", "dropped", "no reply within 600 s")],
        3: [("london", "rejected", missing), ("tokyo", "rejected", missing)],
    }
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="broken-client", strategy="local-sgd", seed=0, config={}, num_rounds_planned=3
        )
        for name in ("london", "tokyo"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        for rnd, rows in plan.items():
            repo.record_round(
                run_id,
                round=rnd,
                model_version=1,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={"accuracy": 0.1},
                train_loss=None,
                updates=[
                    UpdateInput(
                        site=site,
                        dispatched_round=rnd,
                        version_trained_on=rnd - 1,
                        staleness=0,
                        bytes_up=0 if status == "dropped" else 1000,
                        bytes_down=1100,
                        status=status,
                        reason=reason,
                        dispatched_at=t0 + rnd,
                        arrived_at=None if status == "dropped" else t0 + rnd + 0.25,
                        num_examples=100 if status == "applied" else None,
                    )
                    for site, status, reason in rows
                ],
            )
        repo.finish_run(run_id, status="failed", error="rounds 2-3 applied no update")
    return url


def updates_json(*args: str) -> list[dict]:
    return json.loads(history("updates", *args, "--format", "json"))


def test_updates_list_every_update_with_its_reason(failing_ledger: str) -> None:
    rows = updates_json("latest", "--db", failing_ledger)
    assert [(r["round"], r["site"], r["status"]) for r in rows] == [
        (1, "london", "applied"),
        (1, "tokyo", "applied"),
        (2, "london", "rejected"),
        (2, "tokyo", "dropped"),
        (3, "london", "rejected"),
        (3, "tokyo", "rejected"),
    ]
    # JSON carries every field of the record, the whole reason included.
    assert set(rows[0]) == set(UpdateRecord.__dataclass_fields__)
    assert rows[2]["reason"].startswith("missing arrays: [conv1.weight] xxx")
    assert len(rows[2]["reason"]) == len("missing arrays: [conv1.weight] ") + 200
    assert (rows[3]["reason"], rows[3]["bytes_up"], rows[3]["arrived_at"]) == (
        "no reply within 600 s",
        0,
        None,
    )
    out = history("updates", "1", "--db", failing_ledger, "--format", "csv")
    records = list(csv.DictReader(io.StringIO(out)))
    assert len(records) == 6 and set(records[0]) == set(UpdateRecord.__dataclass_fields__)
    assert records[3]["reason"] == "no reply within 600 s"


def test_updates_filter_by_round_site_and_status(failing_ledger: str) -> None:
    def picked(*args: str) -> list[tuple[int, str, str]]:
        return [(r["round"], r["site"], r["status"]) for r in updates_json("1", *args)]

    db = ("--db", failing_ledger)
    assert picked(*db, "--round", "2") == [(2, "london", "rejected"), (2, "tokyo", "dropped")]
    assert picked(*db, "--site", "tokyo", "--status", "dropped") == [(2, "tokyo", "dropped")]
    assert picked(*db, "--status", "rejected") == [
        (2, "london", "rejected"),
        (3, "london", "rejected"),
        (3, "tokyo", "rejected"),
    ]
    assert picked(*db, "--status", "Rejected, dropped", "--round", "2") == [
        (2, "london", "rejected"),
        (2, "tokyo", "dropped"),
    ]
    assert picked(*db, "--round", "3", "--site", "london") == [(3, "london", "rejected")]
    assert picked(*db, "--status", "cancelled") == []


def test_updates_table_shows_reasons_cut_short_with_their_brackets(
    failing_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)
    output = history("updates", "1", "--db", failing_ledger, "--status", "rejected,dropped")
    assert "updates (status rejected, dropped)" in output
    header, _ = read_table(output)
    assert header[:3] == ["round", "site", "status"] and header[-1] == "reason"
    reasons = [line.split("│")[-2].strip() for line in output.splitlines() if "│" in line]
    # The table keeps the brackets (not read as markup) and cuts the reason to 80 characters.
    assert reasons[0].startswith("missing arrays: [conv1.weight] xxx") and reasons[0].endswith("…")
    assert len(reasons[0]) == history_command.REASON_CELL
    assert "no reply within 600 s" in reasons


def test_updates_refuse_bad_filters_in_one_line(failing_ledger: str) -> None:
    bad = runner.invoke(app, ["history", "updates", "1", "--db", failing_ledger, "--status", "ok"])
    assert bad.exit_code == 2
    assert (
        "--status must be one of applied, buffered, cancelled, dropped, rejected "
        "(several: comma-separated), got 'ok'"
    ) in bad.output
    assert "Traceback" not in bad.output
    empty = runner.invoke(app, ["history", "updates", "1", "--db", failing_ledger, "--status", ","])
    assert empty.exit_code == 2 and "--status must be one of" in empty.output
    site = runner.invoke(app, ["history", "updates", "1", "--db", failing_ledger, "--site", "oslo"])
    assert site.exit_code == 5 and "run 1 has no site 'oslo'; its sites: london, tokyo" in (
        site.output
    )
    zero = runner.invoke(app, ["history", "updates", "1", "--db", failing_ledger, "--round", "0"])
    assert zero.exit_code == 2


def test_repository_filters_updates_by_status(failing_ledger: str) -> None:
    with LedgerRepository.open(failing_ledger) as repo:
        assert [u.site for u in repo.list_updates(1, status="dropped")] == ["tokyo"]
        assert len(repo.list_updates(1, status=("rejected", "applied"))) == 5
        with pytest.raises(StorageError, match="unknown update status 'lost'; allowed: applied"):
            repo.list_updates(1, status=["rejected", "lost"])


def test_rounds_name_why_updates_were_not_applied(
    failing_ledger: str, simulated_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)
    header, rows = read_table(history("rounds", "1", "--db", failing_ledger))
    counts = header.index("applied/ dropped/ rejected")
    assert [rows[r][counts] for r in ("1", "2", "3")] == ["2/0/0", "0/1/1", "0/0/2"]
    at = header.index("why not applied")
    assert rows["1"][at] == "-"
    # Round 2 failed two ways: the first recorded reason, and that there was one more.
    assert rows["2"][at].startswith("missing arrays: [conv1.weight] xx")
    assert rows["2"][at].endswith("… (+1 other)")
    assert len(rows["2"][at]) == history_command.REASON_CELL
    assert rows["3"][at].startswith("missing arrays:") and "other" not in rows["3"][at]
    # A run whose every update was applied has no such column.
    clean_header, _ = read_table(history("rounds", "1", "--db", simulated_ledger))
    assert "why not applied" not in clean_header


def record_outcomes(
    repo: LedgerRepository,
    run_id: int,
    rnd: int,
    t0: float,
    outcomes: list[tuple[str, UpdateStatus, str | None]],
) -> None:
    """Round ``rnd`` of the run, committed at t0 + rnd + 0.5, with an update per (site,
    status, reason)."""
    repo.record_round(
        run_id,
        round=rnd,
        model_version=rnd,
        started_at=t0 + rnd,
        finished_at=t0 + rnd + 0.5,
        metrics={"accuracy": 0.5},
        train_loss=None,
        updates=[
            UpdateInput(
                site=site,
                dispatched_round=rnd,
                version_trained_on=rnd - 1,
                staleness=0,
                bytes_up=1000,
                bytes_down=1100,
                status=status,
                reason=reason,
                dispatched_at=t0 + rnd,
                arrived_at=t0 + rnd + 0.25,
                num_examples=100 if status == "applied" else None,
            )
            for site, status, reason in outcomes
        ],
    )


@pytest.fixture
def absent_sites_ledger(new_sqlite_ledger: Callable[[str], str]) -> str:
    """Four rounds of three sites, as a deployed run records them: ohio's SuperNode is
    silent from the start and never answers; tokyo's leaves in round 2 and is back in
    round 4 (and trains in it); london trains every round but round 3, where its update is
    rejected."""
    url = new_sqlite_ledger("absent.db")
    t0 = time.time()
    trained = {1: ["london", "tokyo"], 2: ["london"], 3: [], 4: ["london", "tokyo"]}
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="deployed", strategy="local-sgd", seed=0, config={}, num_rounds_planned=4
        )
        for name in ("london", "ohio", "tokyo"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        presence = [
            (SITE_SILENT_EVENT, "ohio", 0),
            (SITE_LOST_EVENT, "tokyo", 2),
            (SITE_BACK_EVENT, "tokyo", 4),
        ]
        for kind, site, at in presence:
            repo.add_event(run_id, kind, {"site": site, "round": at, "connected": 2, "sites": 3})
        for rnd, sites in trained.items():
            outcomes: list[tuple[str, UpdateStatus, str | None]] = [
                (site, "applied", None) for site in sites
            ]
            if rnd == 3:
                outcomes.append(("london", "rejected", "update norm 1e+06 is over 10 x the median"))
            record_outcomes(repo, run_id, rnd, t0, outcomes)
        repo.finish_run(run_id, status="finished")
    return url


def test_rounds_say_which_sites_trained_and_which_did_not_and_why(
    absent_sites_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: from `history rounds` of a deployed run a user tells which site trained
    each round, and which did not and why, without reading the events."""
    rows = json.loads(history("rounds", "1", "--db", absent_sites_ledger, "--format", "json"))
    assert [r["trained"] for r in rows] == [
        ["london", "tokyo"],
        ["london"],
        [],
        ["london", "tokyo"],
    ]
    assert [r["not_trained"] for r in rows] == [
        {"ohio": "away: silent at start-up"},
        {"ohio": "away: silent at start-up", "tokyo": "away: left in round 2"},
        {
            "london": "rejected: update norm 1e+06 is over 10 x the median",
            "ohio": "away: silent at start-up",
            "tokyo": "away: left in round 2",
        },
        {"ohio": "away: silent at start-up"},  # tokyo is back, and trained
    ]
    monkeypatch.setattr(history_command.console, "width", 400)
    header, table = read_table(history("rounds", "1", "--db", absent_sites_ledger))
    at = header.index("not trained")
    assert table["1"][at] == "ohio away (silent at start-up)"
    assert table["3"][at] == (
        "london rejected, ohio away (silent at start-up), tokyo away (left in round 2)"
    )
    out = history("rounds", "1", "--db", absent_sites_ledger, "--format", "csv")
    records = list(csv.DictReader(io.StringIO(out)))
    assert json.loads(records[1]["not_trained"])["tokyo"] == "away: left in round 2"


def test_a_resume_asks_every_site_again_so_who_was_away_is_said_afresh(
    new_sqlite_ledger: Callable[[str], str],
) -> None:
    """Four rounds, resumed after round 2, two of three sites a round (sampled): tokyo left
    in round 2 and is not said away after the resume (it was asked again, and its later
    rounds without it are the sample's); ohio did not answer the resume's site query, so it
    is away from round 3, said as before round 3, not from the start."""
    url = new_sqlite_ledger("resumed.db")
    t0 = time.time()
    trained = {1: ["london", "tokyo"], 2: ["london"], 3: ["london"], 4: ["london"]}
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="sampled", strategy="local-sgd", seed=0, config={}, num_rounds_planned=4
        )
        for name in ("london", "ohio", "tokyo"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        for rnd, sites in trained.items():
            if rnd == 2:
                detail = {"site": "tokyo", "round": 2, "connected": 2, "sites": 3}
                repo.add_event(run_id, SITE_LOST_EVENT, detail, at=t0 + rnd + 0.1)
            if rnd == 3:  # the resume, between rounds 2 and 3, and its site query
                repo.add_event(run_id, RESUMED_EVENT, {"from_round": 2}, at=t0 + rnd - 0.3)
                detail = {"site": "ohio", "round": None, "connected": 2, "sites": 3}
                repo.add_event(run_id, SITE_SILENT_EVENT, detail, at=t0 + rnd - 0.2)
            record_outcomes(repo, run_id, rnd, t0, [(site, "applied", None) for site in sites])
    rows = json.loads(history("rounds", "1", "--db", url, "--format", "json"))
    assert [r["not_trained"] for r in rows] == [
        {},
        {"tokyo": "away: left in round 2"},
        {"ohio": "away: silent before round 3"},
        {"ohio": "away: silent before round 3"},
    ]


def test_a_site_the_start_waited_for_is_not_said_away(
    new_sqlite_ledger: Callable[[str], str],
) -> None:
    """ohio silent at the start-up and back before round 1 (the start waited for it, as a
    deployment's does for a registered site); K of N rounds (async) that did not take
    ohio's update are the mode's, not ohio's absence."""
    url = new_sqlite_ledger("waited.db")
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="waited", strategy="local-sgd", seed=0, config={}, num_rounds_planned=2
        )
        for name in ("london", "ohio"):
            repo.add_site(run_id, name=name, node_id=len(name), num_examples=100)
        for offset, kind in ((-0.9, SITE_SILENT_EVENT), (-0.5, SITE_BACK_EVENT)):
            detail = {"site": "ohio", "round": None, "connected": 2, "sites": 2}
            repo.add_event(run_id, kind, detail, at=t0 + offset)
        record_outcomes(repo, run_id, 1, t0, [("london", "applied", None)])
        record_outcomes(repo, run_id, 2, t0, [("ohio", "applied", None)])
    rows = json.loads(history("rounds", "1", "--db", url, "--format", "json"))
    assert [r["not_trained"] for r in rows] == [{}, {}]


def test_failure_note_names_counts_and_the_common_reason(failing_ledger: str) -> None:
    with LedgerRepository.open(failing_ledger) as repo:
        rounds = repo.list_rounds(1)
        failed = {
            r.round: repo.list_updates(1, round=r.round, status=FAILED_STATUSES) for r in rounds
        }
    assert failure_note(rounds[0], failed[1]) == ""
    note = failure_note(rounds[2], failed[3], limit=40)
    assert note == "round 3: 2 rejected — missing arrays: [conv1.weight] xxxxxxxx…"
    assert failure_note(rounds[1], failed[2], limit=200).startswith(
        "round 2: 1 rejected, 1 dropped — missing arrays: [conv1.weight] xxx"
    )
    assert common_reason([]) == "-"


def diverged_ledger(tmp_path: Path, *, status: FinalRunStatus) -> str:
    """A run whose round 1 recorded a divergence warning; sites evaluated, not the server."""
    url = f"sqlite:///{tmp_path / 'diverged.db'}"
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="wine [raw]", strategy="local-sgd", seed=0, config={}, num_rounds_planned=2
        )
        for rnd in (1, 2):
            repo.record_round(
                run_id,
                round=rnd,
                model_version=rnd,
                started_at=t0 + rnd,
                finished_at=t0 + rnd + 0.5,
                metrics={"site_accuracy": 0.4},
                train_loss=1e5 if rnd == 1 else 1.1,
                updates=[],
                run_warning="round 1: training diverged: [loss] 1e+05" if rnd == 1 else None,
            )
        repo.finish_run(run_id, status=status, error="stopped" if status == "failed" else None)
    return url


def test_a_diverged_run_shows_its_warning_in_runs_and_rounds(tmp_path: Path) -> None:
    db = diverged_ledger(tmp_path, status="finished")
    runs = runner.invoke(app, ["history", "runs", "--db", db])
    assert runs.exit_code == 0, runs.output
    # The note under the table, literally (its brackets are no markup); the sites' accuracy.
    assert "Run 1 warning: round 1: training diverged: [loss] 1e+05" in runs.output
    assert "0.4" in runs.output
    rounds = runner.invoke(app, ["history", "rounds", "latest", "--db", db])
    assert rounds.exit_code == 0, rounds.output
    assert "site acc" in rounds.output
    assert "Run 1 warning: round 1: training diverged: [loss] 1e+05" in rounds.output
    # JSON stays a list of rounds; the run's JSON carries the note whole.
    shown = runner.invoke(app, ["history", "rounds", "1", "--db", db, "--format", "json"])
    assert [r["round"] for r in json.loads(shown.output)] == [1, 2]
    (run,) = json.loads(runner.invoke(app, ["history", "runs", "--db", db, "-f", "json"]).output)
    assert (run["status"], run["error"]) == ("finished", "round 1: training diverged: [loss] 1e+05")


def test_a_failed_run_keeps_the_warning_after_its_reason(tmp_path: Path) -> None:
    db = diverged_ledger(tmp_path, status="failed")
    rounds = runner.invoke(app, ["history", "rounds", "latest", "--db", db])
    assert "Run 1 failed: stopped; round 1: training diverged" in rounds.output


def test_runs_without_notes_have_no_note_lines(ledger: str) -> None:
    output = runner.invoke(app, ["history", "runs", "--db", ledger]).output
    assert "warning" not in output and "failed" not in output


def test_the_progress_display_prints_a_running_runs_warning_once(tmp_path: Path) -> None:
    from rich.console import Console

    from flplatform.cli.progress import round_progress

    db = diverged_ledger(tmp_path, status="finished")
    with LedgerRepository.open(db) as repo:
        record, done = repo.get_run(1), repo.list_rounds(1)
    console = Console(record=True, width=200)
    with round_progress(console, 2) as show:
        show(record, done[:1], [])
        show(record, done, [])
    out = console.export_text()
    assert out.count("warning: round 1: training diverged: [loss] 1e+05") == 1


# ---------------------------------------------------------------- what a view reads, and when
@pytest.mark.parametrize("view", ["rounds", "updates"])
def test_a_view_of_a_run_being_recorded_shows_one_moment(
    new_sqlite_ledger: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, view: str
) -> None:
    """A view reads the run, then its rounds and updates. Another process that records a
    round and ends the run in between must not show up beside the run row read before it:
    rounds the row does not count, and the reasons of a run it calls running."""
    url = new_sqlite_ledger("recording.db")
    with LedgerRepository.open(url) as repo:
        run_id = make_run(repo, name="recording", num_rounds_planned=3)
        repo.add_site(run_id, name="a", node_id=1)
        record(repo, run_id, 1, [update("a")])

    get_run = LedgerRepository.get_run
    landed: list[int] = []

    def get_run_then_a_round_lands(self: LedgerRepository, run_id: int) -> RunRecord:
        found = get_run(self, run_id)
        if not landed:  # the run's own writer, with its own connection
            with LedgerRepository.open(url) as writer:
                late = update("a", "rejected", dispatched_round=2, reason="arrived late")
                record(writer, run_id, 2, [late])
                writer.finish_run(run_id, status="failed", error="site a went away")
            landed.append(run_id)
        return found

    monkeypatch.setattr(LedgerRepository, "get_run", get_run_then_a_round_lands)
    output = history(view, str(run_id), "--db", url)
    assert landed == [run_id]
    assert f"Run {run_id} (recording, running): {view}" in output
    _, rows = read_table(output)
    assert list(rows) == ["1"]
    assert "arrived late" not in output and "went away" not in output
    # The round was committed: the next look shows it with its run row.
    assert "(recording, failed)" in history(view, str(run_id), "--db", url)


def ledger_at_revision(path: Path, revision: str) -> str:
    """A ledger with one run whose schema is back at ``revision``, as an older flplatform
    left it."""
    url = f"sqlite:///{path}"
    with LedgerRepository.open(url) as repo:
        make_run(repo, name="old")
        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), revision)
    return url


def revision_of(url: str) -> set[str]:
    engine = create_ledger_engine(url)
    try:
        with engine.connect() as connection:
            return current_revisions(connection)
    finally:
        engine.dispose()


def test_history_says_on_stderr_when_it_upgrades_an_older_ledger(tmp_path: Path) -> None:
    url = ledger_at_revision(tmp_path / "old.db", "0007")
    head = head_revision()

    first = runner.invoke(app, ["history", "runs", "--db", url, "--format", "json"])
    assert first.exit_code == 0, first.output
    assert [run["name"] for run in json.loads(first.stdout)] == ["old"]  # stdout stays JSON
    assert first.stderr.splitlines() == [
        f"note: upgraded the schema of the ledger {url} from revision 0007 to {head}, to read "
        "it; a flplatform older than this one no longer opens it"
    ]
    assert revision_of(url) == {head}
    again = runner.invoke(app, ["history", "runs", "--db", url, "--format", "json"])
    assert again.exit_code == 0 and again.stderr == ""  # said once, when it happened


def test_history_leaves_an_older_ledger_it_may_only_read_as_it_is(tmp_path: Path) -> None:
    url = ledger_at_revision(tmp_path / "old.db", "0007")
    result = runner.invoke(app, ["history", "runs", "--db", url + "?mode=ro"])
    assert result.exit_code == 4, result.output
    assert result.stderr.splitlines() == [
        f"error: the ledger schema is at revision 0007, older than this flplatform's "
        f"{head_revision()}, and this connection may only read, so it cannot be upgraded; "
        "open it once with write access (which upgrades it; older flplatform releases then "
        "refuse it) or read it with the flplatform that wrote it"
    ]
    assert revision_of(url) == {"0007"}
