"""Every history table fits 100 columns and cuts nothing, and JSON and CSV keep their fields.

The busiest ledger we can think of (tests/helpers/busy_ledger.py) is rendered by each
table command twice: on a 100-column console, and on one wide enough that nothing wraps.
At 100 columns no line may be longer, every column shown must hold the same values as the
wide table (wrapped or folded, never cut: the only '…' are those ``shorten`` wrote, which the
wide table has too), and the columns left out must be named under the table.
"""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from typer.testing import CliRunner

from flplatform.cli import history as history_command
from flplatform.cli.app import app
from flplatform.cli.render import Column, fitting_columns, make_console
from tests.helpers.busy_ledger import write_busy_ledger

runner = CliRunner()
NARROW = 100

# Each table command, and a column of it that never wraps: a row starts where it has a value.
COMMANDS = [
    (["runs"], "run"),
    (["compare", "1", "2", "3"], "run"),
    (["rounds", "1"], "round"),
    (["rounds", "2"], "round"),
    (["sites", "1"], "updates"),
    (["sites", "2"], "updates"),
    (["updates", "1"], "round"),
    (["updates", "2"], "round"),
    (["traffic", "1"], "kind"),
    (["checkpoints", "1"], "round"),
    (["events", "1"], "at"),
]


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("busy")
    url = f"sqlite:///{folder / 'ledger.db'}"
    write_busy_ledger(url, folder)
    return url


def render(monkeypatch: pytest.MonkeyPatch, args: list[str], url: str, width: int) -> str:
    monkeypatch.setattr(history_command, "console", make_console(width=width))
    result = runner.invoke(app, ["history", *args, "--db", url])
    assert result.exit_code == 0, result.output
    return result.output


def parse(output: str, key: str) -> tuple[list[str], list[dict[str, str]], str]:
    """A rendered table's headers, its rows (each cell's wrapped lines joined, whitespace
    removed) and the text outside the table, on one line."""
    headers: list[list[str]] = []
    rows: list[dict[str, str]] = []
    outside: list[str] = []
    for line in output.splitlines():
        if line.startswith("┃"):
            parts = [part.strip() for part in line.split("┃")[1:-1]]
            headers = headers or [[] for _ in parts]
            for fragments, part in zip(headers, parts, strict=True):
                fragments.extend([part] if part else [])
        elif line.startswith("│"):
            names = [" ".join(fragments) for fragments in headers]
            cells = dict(zip(names, (c.strip() for c in line.split("│")[1:-1]), strict=True))
            if cells[key]:
                rows.append(dict.fromkeys(names, ""))
            for name, value in cells.items():
                rows[-1][name] += "".join(value.split())
        elif not line.startswith(("┏", "┡", "└")):
            outside.append(line.strip())
    return [" ".join(fragments) for fragments in headers], rows, " ".join(outside)


@pytest.mark.parametrize(("args", "key"), COMMANDS, ids=[" ".join(a) for a, _ in COMMANDS])
def test_a_table_fits_100_columns_and_cuts_nothing(
    busy: str, monkeypatch: pytest.MonkeyPatch, args: list[str], key: str
) -> None:
    wide = render(monkeypatch, args, busy, 1000)
    narrow = render(monkeypatch, args, busy, NARROW)
    assert max(len(line) for line in narrow.splitlines()) <= NARROW
    all_headers, wide_rows, wide_outside = parse(wide, key)
    headers, rows, outside = parse(narrow, key)
    assert "Not shown" not in wide_outside
    assert len(rows) == len(wide_rows) > 0
    # Every shown column holds the wide table's values; the others are named.
    for row, wide_row in zip(rows, wide_rows, strict=True):
        assert row == {name: wide_row[name] for name in headers}
    hidden = [name for name in all_headers if name not in headers]
    if hidden:
        match = re.search(r"Not shown at 100 columns: (.*?) \(a wider terminal", outside)
        assert match is not None and match.group(1) == ", ".join(hidden)
    else:
        assert "Not shown" not in outside
    assert narrow.count("…") == wide.count("…") - sum(
        value.count("…") for row in wide_rows for name, value in row.items() if name in hidden
    )


def test_the_essential_columns_stay_at_100(busy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    headers, rows, outside = parse(render(monkeypatch, ["runs"], busy, NARROW), "run")
    assert headers[:5] == ["run", "name", "status", "strategy", "sync"]
    assert {"rounds", "accuracy"} <= set(headers)
    # A user's own app records no sync mode; its strategy is the name it was recorded under.
    own = next(row for row in rows if row["run"] == "2")
    assert (own["strategy"], own["sync"]) == ("FedAvgWithAVe…", "-")
    assert "Run 1 failed: stopped by the user (SIGINT)" in outside


def test_a_console_is_as_wide_as_the_terminal_or_100_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    # Under pytest, stdout is no terminal (fd-level capture).
    monkeypatch.setattr("sys.__stdout__", io.StringIO())
    assert make_console().width == NARROW
    monkeypatch.setenv("COLUMNS", "132")
    assert make_console().width == 132
    assert make_console(width=80).width == 80


def test_columns_are_dropped_in_their_order_until_the_table_fits() -> None:
    columns = [Column("a"), Column("b", drop=2), Column("c", drop=1), Column("d", drop=2)]
    cells = [["x" * 10] * 4]
    assert fitting_columns(columns, cells, 1 + 4 * 13) == [0, 1, 2, 3]
    assert fitting_columns(columns, cells, 1 + 3 * 13) == [0, 1, 2]  # the rightmost of equals
    assert fitting_columns(columns, cells, 1 + 2 * 13) == [0, 2]
    assert fitting_columns(columns, cells, 10) == [0]  # never the kept ones
    # A narrow column dropped before a wide one comes back when it fits in their room.
    sized = [Column("a"), Column("wide", drop=2), Column("n", drop=3)]
    assert fitting_columns(sized, [["x" * 10, "y" * 30, "z"]], 1 + 13 + 33) == [0, 1]
    assert fitting_columns(sized, [["x" * 10, "y" * 30, "z"]], 1 + 13 + 5) == [0, 2]
    # Free text counts at most TEXT_MIN_WIDTH: it wraps.
    text = [Column("a"), Column("note", text=True), Column("b", drop=1)]
    assert fitting_columns(text, [["x" * 10, "y " * 100, "z" * 10]], 1 + 13 + 19 + 13) == [0, 1, 2]


# ---------------------------------------------------------------- JSON and CSV stay as they were
KEYS = {
    "runs": "id,tag,name,strategy,seed,config,num_rounds_planned,status,error,created_at,"
    "finished_at,wall_seconds,final_metrics,rounds_completed,last_metrics,network,"
    "simulated_seconds,owner,bytes_up,bytes_down",
    "rounds 1": "id,run_id,round,model_version,started_at,finished_at,wall_seconds,metrics,"
    "train_loss,num_applied,num_dropped,num_rejected,bytes_up,bytes_down,eval_bytes_up,"
    "eval_bytes_down,virtual_started_at,virtual_finished_at,trained,not_trained",
    "sites 1": "site_id,name,node_id,partition_id,num_examples,updates,applied,buffered,"
    "cancelled,dropped,rejected,mean_staleness,max_staleness,bytes_up,bytes_down,"
    "compute_seconds,mean_train_loss,evaluations,eval_bytes_up,eval_bytes_down,"
    "staleness_counts,p90_staleness,waiting_seconds,busy_seconds,waiting_clock,"
    "virtual_compute_seconds,transfer_seconds,mean_delay,queries,query_bytes_up,"
    "query_bytes_down,total_bytes_up,total_bytes_down",
    "updates 1": "id,run_id,site_id,site,round,dispatched_round,version_trained_on,staleness,"
    "bytes_up,bytes_down,compute_seconds,status,reason,num_examples,train_loss,dispatched_at,"
    "arrived_at,virtual_dispatched_at,virtual_arrived_at,virtual_compute_seconds,"
    "transfer_seconds,period,average_applied,delay,fragment",
    "traffic 1": "id,run_id,site_id,site,round,kind,messages,bytes_up,bytes_down",
    "checkpoints 1": "id,run_id,round,model_version,path,size_bytes,kept,created_at,file_present",
    "events 1": "id,run_id,at,kind,detail",
}


@pytest.mark.parametrize("command", list(KEYS))
def test_json_and_csv_keep_their_fields(busy: str, command: str) -> None:
    expected = KEYS[command].split(",")
    args = ["history", *command.split(), "--db", busy]
    rows = json.loads(runner.invoke(app, [*args, "--format", "json"]).output)
    assert rows and all(list(row) == expected for row in rows)
    out = runner.invoke(app, [*args, "--format", "csv"]).output
    assert next(csv.reader(io.StringIO(out))) == expected


def test_csv_cells_with_line_breaks_and_delimiters_read_back_whole() -> None:
    """A site or run name may hold a carriage return: with "\\n" rows, Python 3.11 left
    it unquoted and a reader split the row in two."""
    from flplatform.cli.render import to_csv

    names = ["cr\rsite", "lf\nsite", "crlf\r\nsite", 'q"uote', "com,ma", " lead", "東京"]
    records = [{"site": name, "n": i, "curve": [1, 2]} for i, name in enumerate(names)]
    rows = list(csv.DictReader(io.StringIO(to_csv(records), newline="")))
    assert [row["site"] for row in rows] == names
    assert [row["n"] for row in rows] == [str(i) for i in range(len(names))]


def test_names_and_reasons_reach_the_terminal_without_control_sequences() -> None:
    from flplatform.cli.render import Column, OutputFormat, emit

    console = make_console(width=120)
    with console.capture() as captured:
        emit(
            console,
            OutputFormat.table,
            title="Run \x1b]0;title\x07",
            records=[],
            columns=[Column("reason", text=True)],
            rows=[["esc\x1b[2Jred \x9b31m\rhidden 東京"]],
        )
    shown = captured.get()
    assert not any(c in shown for c in "\x1b\x07\x9b\r")
    assert "esc?[2Jred ?31m?hidden 東京" in shown and "Run ?]0;title?" in shown
