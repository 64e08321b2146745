"""Bad input gets one line naming the problem, a non-zero exit code, never a traceback.

All of these fail before Flower starts, so they are fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flplatform.cli.progress import db_argument
from tests.helpers.cli import invoke, one_error_line


@pytest.mark.usefixtures("flplatform_home")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--strategy", "magic"],
            "unknown strategy 'magic'; allowed: delayed, dga, diloco, dts, fedavg, fedavgm, "
            "fetchsgd, local-sgd, sketched-sgd",
        ),
        (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (["--model", "vgg"], "unknown model 'vgg'; allowed: mlp, cnn"),
        (["--partition", "zipf"], "unknown partition 'zipf'; allowed: iid, dirichlet"),
        (["--rounds", "0"], "num-server-rounds must be > 0"),
        (["--rounds", "-3"], "num-server-rounds must be > 0"),
        (["--sites", "0"], "--sites must be a positive count"),
        (["--sites", "-2"], "--sites must be a positive count"),
        (["--alpha", "0"], "alpha must be a finite number > 0"),
        (["--alpha", "-1"], "alpha must be a finite number > 0"),
        (["--lr", "0"], "lr must be > 0"),
        (["--momentum", "1.5"], "momentum must be in [0, 1)"),
        (["--batch-size", "0"], "batch-size must be > 0"),
        (["--fraction-train", "0"], "fraction-train must be in (0, 1]"),
        (["--local-epochs", "0"], "set local-steps"),
        (["--sites", "a,a"], "duplicate names"),
        (["--db", "nosuchdriver://x/y"], "cannot open database"),
        (["--db", "not a url"], "database"),
        (["--dataset", "/nonexistent/data.npz"], "/nonexistent/data.npz"),
        (["--partition", "files"], "set dataset to the directory written by"),
        (["--partition", "files", "--dataset", "/nonexistent/split"], "/nonexistent/split"),
        (["--sync", "eventually"], "unknown sync 'eventually'; allowed: sync, k-sync"),
        (["--sync", "k-async", "--k", "-1"], "k must be a whole number"),  # 0: the default K
        # a sketched strategy's k counts coordinates: K's default would apply two a step
        (["--strategy", "fetchsgd"], "k must be an integer >= 1: the coordinates applied"),
        (["--strategy", "sketched-sgd"], "k must be an integer >= 1: the coordinates applied"),
        (["--sync", "k-sync", "--staleness-bound", "2"], "applies to the async modes"),
        (["--sync", "async", "--staleness-weighting", "cubic"], "staleness weighting 'cubic'"),
        (["--sync", "async", "--adasync"], "adasync grows K"),
        (["--network", "mars"], "mars"),
        (["--network", "/nonexistent/net.toml"], "/nonexistent/net.toml"),
        (["--compute-model", "pareto"], "also set network"),
        (["--network", "world", "--compute-model", "gaussian"], "gaussian"),
        (["--network", "world", "--step-seconds", "-1"], "step"),
        (["--delay", "3"], "use them with strategy 'delayed'"),
        (["--strategy", "delayed", "--delay", "-1"], "delay must be an integer >= 0"),
        (["--strategy", "delayed", "--sync", "k-async"], "runs with sync mode 'sync' only"),
        (
            ["--strategy", "fetchsgd", "--k", "5000"],
            "--k 5000 exceeds the 4810 parameters of model 'mlp' on digits; choose k <= 4810 "
            "or a model with at least k parameters (cnn, wide-mlp, resnet)",
        ),
        (["--strategy", "sketched-sgd", "--k", "4811"], "--k 4811 exceeds the 4810"),
    ],
)
def test_simulate_rejects_bad_input(args: list[str], expected: str) -> None:
    result = invoke(["simulate", *args])
    assert result.exit_code not in (0, 70), result.output  # 70 would be an unexpected bug
    assert expected in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_top_k_check_names_only_models_large_enough() -> None:
    from flplatform.app.config import RunConfig
    from flplatform.cli.simulate import check_top_k
    from flplatform.core.errors import ConfigError

    # mlp 4810, cnn 13706, wide-mlp 48010, resnet 1296378 (its convolutions do not grow with H, W)
    digits = {"input_shape": (1, 8, 8), "num_classes": 10}

    def config(model: str, k: int) -> RunConfig:
        return RunConfig.from_mapping({"strategy": "fetchsgd", "model": model, "k": k})

    check_top_k(config("mlp", 4810), **digits)  # k = d is allowed
    with pytest.raises(ConfigError, match=r"13706 parameters .*\(wide-mlp, resnet\)$"):
        check_top_k(config("cnn", 20000), **digits)
    with pytest.raises(ConfigError, match=r"48010 parameters .*\(resnet\)$"):
        check_top_k(config("wide-mlp", 60000), **digits)
    with pytest.raises(ConfigError, match=r"choose k <= 1296378$"):
        check_top_k(config("resnet", 2_000_000), **digits)


@pytest.mark.usefixtures("flplatform_home")
def test_malformed_npz_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((10, 4)), y=np.arange(9))  # lengths differ
    result = invoke(["simulate", "--dataset", str(bad)])
    assert result.exit_code == 3
    assert "bad.npz" in one_error_line(result.output)

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip file")
    result = invoke(["simulate", "--dataset", str(garbage)])
    assert result.exit_code == 3
    assert "garbage.npz" in one_error_line(result.output)


def test_unwritable_database_directory(tmp_path: Path) -> None:
    result = invoke(["history", "runs", "--db", f"sqlite:///{tmp_path}/missing/dir/l.db"])
    assert result.exit_code == 4
    assert "missing/dir" in one_error_line(result.output)


def test_postgres_that_is_not_there(tmp_path: Path) -> None:
    url = "postgresql+psycopg://nobody:secret@127.0.0.1:1/none?connect_timeout=2"
    result = invoke(["history", "runs", "--db", url])
    assert result.exit_code == 4
    line = one_error_line(result.output)
    assert "cannot open database" in line
    assert "secret" not in line  # the password is masked


def test_a_url_too_malformed_to_parse_is_quoted_without_its_password() -> None:
    result = invoke(["simulate", "--db", "postgresql+psycopg://amy:s3cret@db:port/ledger"])
    assert result.exit_code == 4
    line = one_error_line(result.output)
    assert "cannot parse database URL 'postgresql+psycopg://amy:***@db:port/ledger'" in line
    assert "s3cret" not in result.output


def test_a_suggested_command_repeats_the_url_without_its_password() -> None:
    url = "postgresql+psycopg://amy:s3cret@db.example/ledger"
    assert db_argument(url) == " --db postgresql+psycopg://amy@db.example/ledger"


def test_bad_option_type_is_a_usage_error_not_a_traceback() -> None:
    result = invoke(["simulate", "--rounds", "three"])
    assert result.exit_code == 2
    assert "three" in result.output


@pytest.mark.usefixtures("flplatform_home")  # forget_snapshots reads the home
def test_the_cli_starts_and_checks_a_configuration_without_torch() -> None:
    """``flplatform --help``, ``history``, a bad option: torch (2–3 s to import) loads only
    when a run starts (the strategies' knobs are checked in strategies/knobs.py), and not
    in the CLI's own process even then: following a simulation and forgetting its
    snapshots once it finished need none of it."""
    code = (
        "import sys\n"
        "import flplatform.cli.app\n"
        "from flplatform.app.config import RunConfig\n"
        "from flplatform.launch.simulation import forget_snapshots\n"
        "from types import SimpleNamespace\n"
        "for strategy in ('local-sgd', 'delayed', 'fetchsgd', 'sketched-sgd'):\n"
        "    RunConfig.from_mapping({'strategy': strategy, 'k': 10})\n"
        "RunConfig.from_mapping({'codec': 'topk:0.01'})\n"
        "forget_snapshots(SimpleNamespace(tag='run-a'))  # a RunRecord's tag is all it reads\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("option", ["--out", "--tensorboard"])
@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_the_demo_refuses_a_plot_folder_that_is_a_file_before_it_trains(
    tmp_path: Path, option: str, under: bool
) -> None:
    """The demo writes its plots after every panel has trained (minutes): a folder it could
    never write is refused first, and no run starts."""
    ledger = tmp_path / "ledger.db"
    (tmp_path / "taken").write_text("a user's file")
    folder = tmp_path / "taken" / "plots" if under else tmp_path / "taken"
    result = invoke(["demo", "cross-silo", "--db", f"sqlite:///{ledger}", option, str(folder)])
    assert result.exit_code == 2
    assert one_error_line(result.output).endswith(
        f"{option} must be a folder, and {folder} "
        + (f"is under {tmp_path / 'taken'}, a file" if under else "is a file")
    )
    assert not ledger.exists()  # checked before the ledger was opened
    assert (tmp_path / "taken").read_text() == "a user's file"
