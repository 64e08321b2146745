"""A Flower user's own app (examples/own_app) gets every algorithm through one mod.

The app is written as Flower's quickstarts write one: its own CNN with BatchNorm (running
statistics and the integer ``num_batches_tracked``) and dropout, its own data and training
loop, ``@app.train(mods=[flplatform_mod()])``, and a ServerApp calling
``flplatform.start``. Each run: 2 sites, 2-3 rounds on 8×8 digits.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.app.tracking import tensorboard_directory
from flplatform.cli.app import app
from flplatform.launch.flower import flower_environment, start_superlink, stop_process
from storage import LedgerRepository, RoundRecord, RunRecord, UpdateRecord

ROOT = Path(__file__).resolve().parents[2]
OWN_APP = ROOT / "examples" / "own_app"
MODEL_BYTES = 13_802 * 4  # the example's float32 weights (its buffers add a little)

runner = CliRunner()


@pytest.fixture
def own_app(tmp_path: Path) -> Path:
    """A copy of the example (Flower builds its FAB from the directory)."""
    target = tmp_path / "own_app"
    shutil.copytree(OWN_APP, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def run_own_app(
    app_dir: Path, db: str, *args: str
) -> tuple[RunRecord, list[RoundRecord], list[UpdateRecord]]:
    result = runner.invoke(app, ["run", str(app_dir), "--sites", "2", "--db", db, *args])
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        return run, repo.list_rounds(run.id), repo.list_updates(run.id)


def assert_trained(run: RunRecord, rounds: list[RoundRecord], num_rounds: int) -> None:
    assert run.status == "finished", run.error
    assert [r.round for r in rounds] == list(range(1, num_rounds + 1))
    assert all(r.num_rejected == 0 and r.num_dropped == 0 for r in rounds)
    assert sum(r.num_applied for r in rounds) >= 2 * num_rounds - 2
    assert all(r.bytes_up > 0 and r.bytes_down > 0 for r in rounds)
    assert "accuracy" in rounds[-1].metrics


def test_each_seed_round_and_site_draws_batches_and_dropout_of_its_own() -> None:
    spec = importlib.util.spec_from_file_location("own_app_task", OWN_APP / "own_app" / "task.py")
    assert spec is not None and spec.loader is not None
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    triples = [(s, r, p) for s in range(3) for r in range(6) for p in range(4)]
    drawn = [task.site_seeds(*triple) for triple in triples]
    every = [seed for pair in drawn for seed in pair]
    assert len(set(every)) == len(every)  # no triple repeats another's, nor its own twice
    assert drawn == [task.site_seeds(*triple) for triple in triples]


@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
def test_local_sgd_k_async_on_the_world_network(own_app: Path, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    run, rounds, updates = run_own_app(
        own_app,
        db,
        *("--rounds", "3", "--network", "world", "--sync", "k-async", "--k", "2"),
        *("-c", "learning-rate=0.1", "--tensorboard", str(tmp_path / "tb")),
    )
    assert_trained(run, rounds, 3)
    # --tensorboard: the app's rounds, logged as it trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_directory(tmp_path / "tb", run.id, run.name)))
    events.Reload()
    assert [s.step for s in events.Scalars("accuracy")] == [1, 2, 3]
    assert [s.value for s in events.Scalars("accuracy")] == pytest.approx(
        [r.metrics["accuracy"] for r in rounds]
    )
    # The app's own key passed through untouched; the tag reached start() only through
    # FLPLATFORM_OPTIONS (the run was found by it); its query handler named the sites.
    assert run.config["learning-rate"] == 0.1 and run.tag
    with LedgerRepository.open(db) as repo:
        assert sorted(s.name for s in repo.list_sites(run.id)) == ["site-0", "site-1"]
    assert run.name == "own-app-local-sgd" and run.network == "world"
    # FLPLATFORM_OPTIONS reached start(): it ran k-async on the simulated clock.
    assert run.config["sync"] == "k-async" and run.config["k"] == 2
    assert run.simulated_seconds is not None and run.simulated_seconds > 0
    assert all(r.num_applied == 2 for r in rounds)
    # Whole models go up (Flower's convention): about the model's size per update.
    assert all(u.bytes_up >= MODEL_BYTES for u in updates if u.status == "applied")
    assert rounds[-1].metrics["accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
@pytest.mark.parametrize(
    ("strategy", "extra", "upload_share"),
    [
        # delayed + top-1% uploads (index + value per coordinate): the delayed mod and the
        # codec mod together. The codec mod alone runs in test_compression's top-k run
        # (the built-in app uses the same mod); int8 on a user's BatchNorm model in
        # tests/strategies/test_users_model_under_every_algorithm.py, its upload sizes in
        # tests/strategies/test_local_sgd_codecs.py.
        ("dts", (), 0.1),
        ("fetchsgd", ("-c", "top-k=200"), None),  # a 5 × 1000 sketch
        ("sketched-sgd", ("-c", "top-k=200"), None),
    ],
    ids=["dts", "fetchsgd", "sketched-sgd"],
)
def test_every_algorithm_through_the_mod(
    own_app: Path,
    tmp_path: Path,
    strategy: str,
    extra: tuple[str, ...],
    upload_share: float | None,
) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    run, rounds, updates = run_own_app(own_app, db, "--rounds", "3", "--strategy", strategy, *extra)
    assert_trained(run, rounds, 3)
    assert run.name == f"own-app-{strategy}" and run.config["strategy"] == strategy
    applied = [u for u in updates if u.status == "applied"]
    assert applied and all(u.bytes_up > 0 for u in applied)
    dense = max(u.bytes_down for u in updates)  # the first round sends every site the model
    assert dense > MODEL_BYTES
    if upload_share is not None:
        assert all(u.bytes_up <= upload_share * dense for u in applied), (
            [u.bytes_up for u in applied],
            dense,
        )
    if strategy in ("fetchsgd", "sketched-sgd"):
        sketch = 5 * 1000 * 4
        assert any(sketch <= u.bytes_up < sketch + 4096 for u in applied), [
            u.bytes_up for u in applied
        ]


@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
def test_plain_flwr_run_of_the_same_app(own_app: Path, flplatform_home: Path) -> None:
    """`flwr run examples/own_app` without flplatform's CLI: no FLPLATFORM_OPTIONS, the
    app's own config, its ServerApp's own ledger choice (the default ledger)."""
    env = flower_environment(flplatform_home)
    superlink, superlink_log = start_superlink(env, home=flplatform_home, log_name="plain")
    try:
        # The app's declared 5 rounds, shortened with Flower's own -c.
        result = subprocess.run(
            ["flwr", "run", str(own_app), "local", "--stream", "-c", "num-server-rounds=2"],
            env=env,
            cwd=str(flplatform_home),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        deadline = time.monotonic() + 30
        while True:
            with LedgerRepository.open(None) as repo:  # $FLPLATFORM_HOME/ledger.db
                runs = repo.list_runs()
                if runs and runs[0].status != "running" or time.monotonic() > deadline:
                    break
            time.sleep(0.5)
    finally:
        stop_process(superlink)
    with LedgerRepository.open(None) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished", (run.error, superlink_log.read_text()[-2000:])
        assert run.tag is None and run.network is None  # nothing from flplatform run
        rounds = repo.list_rounds(run.id)
        assert [r.num_applied for r in rounds] == [2, 2]
        assert rounds[-1].metrics["accuracy"] > 0.3


# ------------------------------------------------------------------ --model MODULE:FACTORY
USER_MODEL = """
from torch import nn


def Net():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
"""


@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
def test_simulate_with_a_model_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flplatform simulate --model mymodel:Net` next to mymodel.py: the built-in sites and
    the ServerApp, in Flower's processes, build the user's model."""
    work = tmp_path / "work"
    work.mkdir()
    name = "usermodel_sim"
    (work / f"{name}.py").write_text(USER_MODEL)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cwd is appended to a copy
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = runner.invoke(
        app,
        ["simulate", "--model", f"{name}:Net", "--sites", "2", "--rounds", "2", "--db", db],
    )
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished" and run.config["model"] == f"{name}:Net"
        rounds = repo.list_rounds(run.id)
        assert [r.num_applied for r in rounds] == [2, 2]
        # 64·32+32 + 32·10+10 = 2 410 float32 weights: not the built-in mlp's 4 810.
        assert all(u.bytes_up < 4810 * 4 for u in repo.list_updates(run.id))


@pytest.mark.slow
@pytest.mark.usefixtures("flplatform_home")
def test_run_the_generic_serverapp_with_a_model_from_the_app(tmp_path: Path) -> None:
    """`flplatform run examples/plain_flower_client --model plain_client:Net`: flplatform's
    ServerApp builds the app's own model class from the installed app directory, and skips
    the app's own run-config keys (here one more, for its ClientApp)."""
    plain = tmp_path / "plain"
    shutil.copytree(
        ROOT / "examples" / "plain_flower_client",
        plain,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    with (plain / "pyproject.toml").open("a") as pyproject:  # [tool.flwr.app.config] is last
        pyproject.write("client-only-knob = 1\n")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["run", str(plain), "--sites", "2", "--rounds", "2", "--db", db]
    result = runner.invoke(
        app,
        [
            *args,
            "--model",
            "plain_client:Net",
            "-c",
            "fraction-evaluate=0",
            "-c",
            "client-only-knob=2",
        ],
    )
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished" and run.config["model"] == "plain_client:Net"
        assert "client-only-knob" not in run.config  # not ours: left to the app
        assert [r.num_applied for r in repo.list_rounds(run.id)] == [2, 2]
