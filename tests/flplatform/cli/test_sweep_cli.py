"""Sweeps on the CLI: bad lists are one line before anything starts; ``--name`` reaches the
run (``simulate`` and ``run``); the closing table. tests/integration/test_sweep.py runs one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.app.config import RunConfig
from flplatform.app.federation import platform_options
from flplatform.cli.app import app
from flplatform.cli.simulate import console, show_sweep
from flplatform.core.errors import ConfigError
from flplatform.launch.app_directory import RunOverrides, plan_run, read_app
from flplatform.launch.simulation import run_sweep
from flplatform.run.options import OPTIONS_ENV
from storage import LedgerRepository
from tests.helpers.cli import invoke, one_error_line

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


def error_line(args: list[str]) -> str:
    result = invoke(args)
    assert result.exit_code == 2, result.output
    return one_error_line(result.output)


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["--sync", "sync,k-asink"],
            "error: sync k-asink cannot run in any combination: unknown sync 'k-asink'; "
            "allowed: sync, k-sync",
        ),
        (
            ["--seed", "1,two"],
            "error: seed two cannot run in any combination: seed must be an integer, got 'two'",
        ),
        (
            ["--strategy", "delayed", "--sync", "k-async,async"],
            "error: no combination of the sweep can run: strategy 'delayed' runs with sync "
            "mode 'sync' only, got 'k-async'",
        ),
        (
            ["--sync", "k-sync", "--k", "2,9"],
            "error: k 9 cannot run in any combination: k 9 is more than the 4 sites",
        ),
        (["--seed", "1,,2"], "error: --seed '1,,2' lists an empty value"),
        (["--codec", "int8,int8"], "error: codec lists int8 more than once"),
        # One value: the single run's own checks, as before.
        (["--k", "x"], "error: k must be an integer, got 'x'"),
    ],
)
@pytest.mark.usefixtures("flplatform_home")
def test_a_bad_sweep_is_one_line_and_starts_nothing(
    tmp_path: Path, args: list[str], says: str
) -> None:
    db = tmp_path / "ledger.db"
    line = error_line(["simulate", "--rounds", "1", "--db", f"sqlite:///{db}", *args])
    assert line.startswith(says), line
    assert not db.exists()  # refused before the ledger is even opened


@pytest.mark.usefixtures("flplatform_home")
def test_runs_with_different_sites_cannot_share_a_simulation(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    three = RunConfig.from_mapping({"sites": "a,b,c", "db": db, "name": "three"})
    two = RunConfig.from_mapping({"sites": "a,b", "db": db, "name": "two"})
    with pytest.raises(ConfigError, match="the runs of a sweep share their sites"):
        run_sweep([three, two])
    assert not (tmp_path / "ledger.db").exists()


def test_a_name_names_the_run_and_the_default_is_strategy_and_dataset() -> None:
    assert platform_options(RunConfig())["name"] == "local-sgd-digits"
    named = RunConfig.from_mapping({"name": "my [test]", "strategy": "dts"})
    assert platform_options(named)["name"] == "my [test]"


@pytest.mark.usefixtures("flplatform_home")
def test_run_hands_its_name_to_start_and_to_the_generic_serverapp(tmp_path: Path) -> None:
    plain = read_app(ROOT / "examples" / "plain_flower_client")
    plan = plan_run(plain, RunOverrides(name="mine  "), tag="t1")
    assert json.loads(plan.environment()[OPTIONS_ENV])["name"] == "mine"
    assert plan.run_config["name"] == "mine"
    result = runner.invoke(app, ["run", str(ROOT / "examples" / "own_app"), "--name", " "])
    assert "error: --name must not be empty" in result.output


def test_the_closing_table_lists_every_run_and_how_to_compare_them(sqlite_ledger: str) -> None:
    db = sqlite_ledger
    members = [RunConfig.from_mapping({"name": name}) for name in ("one [a]", "two", "three")]
    with LedgerRepository.open(db) as repository:
        ids = [
            repository.create_run(
                name=m.run_name, strategy="local-sgd", seed=0, config={}, num_rounds_planned=2
            )
            for m in members[:2]
        ]
        repository.finish_run(ids[0], status="finished", final_metrics={"accuracy": 0.875})
        repository.finish_run(ids[1], status="failed", error="boom")
        records = [repository.get_run(i) for i in ids] + [None]
    with console.capture() as captured:
        show_sweep(members, records, db)
    text = captured.get()
    assert "one [a]" in text and "0.875" in text and "failed" in text
    assert "three" in text and "not started" in text
    assert f"flplatform history compare {ids[0]} {ids[1]} --db {db}" in text
