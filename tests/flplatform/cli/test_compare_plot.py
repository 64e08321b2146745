"""`flplatform history compare` and `flplatform plot` on a SQLite ledger written by hand
(tests/helpers/comparison_ledger.py has the numbers)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.app.comparison import X_AXES, RunSummary
from flplatform.cli import history as history_command
from flplatform.cli import plot as plot_command
from flplatform.cli.app import app
from tests.helpers.cli import output_of, read_table
from tests.helpers.comparison_ledger import write_comparison_ledger

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)  # every column


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The hand-worked ledger, written once: no test writes to it."""
    url = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'ledger.db'}"
    write_comparison_ledger(url)
    return url


def test_compare_shows_one_row_per_run(ledger: str) -> None:
    output = output_of("history", "compare", "1", "2", "3", "--db", ledger)
    assert "target accuracy 0.9" in output and "simulated clock (sim)" in output
    header, rows = read_table(output)
    assert header == [
        "run",
        "name",
        "strategy",
        "sync",
        "K",
        "model",
        "codec",
        "seed",
        "final acc",
        "best acc",
        "time to 0.9",
        "rounds",
        "bytes up",
        "bytes down",
        "bytes up to 0.9",
    ]
    assert rows["1"] == [
        "1",
        "stragglers: k-async K=2",
        "local-sgd",
        "k-async",
        "2",
        "cnn",
        "int8",
        "4",
        "0.91",
        "0.92",
        "25.5 sim",
        "3",
        "844 B",
        "5.2 KiB",
        "500 B",
    ]
    # The wall clock, said so; a run of one's own app shows what it has.
    at = header.index("time to 0.9")
    assert (rows["2"][at], rows["2"][header.index("K")]) == ("6.0 wall", "-")
    assert rows["3"][1:8] == ["my-app", "MyFedAvg", "-", "-", "-", "-", "1"]
    assert rows["3"][at] == "-"


def test_compare_json_has_every_field_and_the_curve(ledger: str) -> None:
    rows = json.loads(
        output_of(
            "history", "compare", "latest", "1", "--target", "0.5", "-f", "json", "--db", ledger
        )
    )
    assert [r["run_id"] for r in rows] == [4, 1]  # latest: the newest run
    assert list(rows[1]) == [f.name for f in fields(RunSummary)]
    assert (rows[1]["time_to_target"], rows[1]["bytes_up_to_target"]) == (10.0, 300)
    assert [p["accuracy"] for p in rows[1]["curve"]] == [0.5, 0.92, 0.91]


def test_compare_csv_has_every_field_but_the_curve(ledger: str) -> None:
    out = output_of("history", "compare", "1", "2", "--format", "csv", "--db", ledger)
    records = list(csv.DictReader(io.StringIO(out)))
    assert list(records[0]) == [f.name for f in fields(RunSummary) if f.name != "curve"]
    assert [(r["clock"], r["time_to_target"]) for r in records] == [
        ("simulated", "25.5"),
        ("wall", "6.0"),
    ]
    assert json.loads(records[0]["mean_staleness"]) == {"london": 1.0, "tokyo": 0.0}


def test_compare_names_what_is_wrong(ledger: str) -> None:
    missing = runner.invoke(app, ["history", "compare", "1", "42", "43", "--db", ledger])
    assert missing.exit_code == 5
    assert "runs 42, 43 do not exist" in missing.output and "Traceback" not in missing.output
    bad = runner.invoke(app, ["history", "compare", "1", "x", "--db", ledger])
    assert bad.exit_code == 2 and "RUN must be a run id (an integer) or 'latest', got 'x'" in (
        bad.output
    )
    target = runner.invoke(app, ["history", "compare", "1", "--target", "90", "--db", ledger])
    assert target.exit_code == 2 and "the target is an accuracy in (0, 1], got 90" in target.output
    none = runner.invoke(app, ["history", "compare", "--db", ledger])
    assert none.exit_code == 2 and "Missing argument 'RUN...'" in " ".join(
        none.output.replace("│", " ").split()
    )


def test_plot_writes_a_png_of_the_runs(ledger: str, tmp_path: Path) -> None:
    out = tmp_path / "plots" / "runs.png"
    args = ["plot", "1", "2", "--x", "rounds", "--target", "0.9", "--db", ledger]
    output = output_of(*args, "--out", str(out), "--title", "Mine [bold]")
    assert f"Plot: {out}" in output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for x in X_AXES:  # simulated time: run 1 only (run 2 ran on the wall clock)
        output_of("plot", "1", "--x", x, "--out", str(tmp_path / f"{x}.png"), "--db", ledger)
        assert (tmp_path / f"{x}.png").stat().st_size > 0


def test_plot_names_what_is_wrong(ledger: str, tmp_path: Path) -> None:
    def refused(*args: str) -> str:
        result = runner.invoke(app, ["plot", *args, "--db", ledger])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        return " ".join(result.output.replace("│", " ").split())  # usage errors come boxed

    png = str(tmp_path / "a.png")
    assert "'time' is not one of 'simulated-time', 'rounds', 'bytes'" in refused(
        "1", "--x", "time", "--out", png
    )
    assert "run 3 recorded no accuracy" in refused("1", "3", "--out", png)
    assert "run 2 ran on the wall clock" in refused("1", "2", "--out", png)
    assert "must end in .png" in refused("1", "--out", str(tmp_path / "a.pdf"))
    (tmp_path / "file").write_text("")
    assert "cannot write the plot to" in refused("1", "--out", str(tmp_path / "file" / "a.png"))
    assert "Missing option '--out'" in refused("1")
    assert not (tmp_path / "a.png").exists()


def test_the_x_choices_are_the_comparison_s() -> None:
    assert tuple(axis.value for axis in plot_command.XAxis) == X_AXES
