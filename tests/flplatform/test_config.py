"""Run configuration: parsed once, bad values named with what is allowed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import derive_seed, rng_for

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_app_config_parses_to_the_defaults() -> None:
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"
    ]
    assert RunConfig.from_mapping(app_config) == RunConfig()


# Flower apps whose ServerApp is flplatform's: each declares every option.
GENERIC_APPS = [".", "examples/plain_flower_client", "tests/integration/apps/attack_app"]


@pytest.mark.parametrize("app", GENERIC_APPS)
def test_every_flower_app_declares_every_config_key(app: str) -> None:
    """Flower refuses a run config key its app does not declare ("Invalid run
    configuration"), and the CLI passes them all. A sub-table is the app's own keys (the
    attack app's ``attack.*``)."""
    app_config = tomllib.loads((ROOT / app / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"
    ]
    ours = [key for key, value in app_config.items() if not isinstance(value, dict)]
    assert sorted(ours) == sorted(RunConfig().to_run_config())


@pytest.mark.parametrize("app", GENERIC_APPS)
def test_pyproject_app_config_is_written_from_the_options_table(app: str) -> None:
    """Flower reads the static file: it must say what RunConfig's fields say (regenerate
    with `python -m flplatform.app.app_config pyproject.toml examples/plain_flower_client/...
    tests/integration/apps/attack_app/pyproject.toml`)."""
    from flplatform.app.app_config import rewrite_app_config

    path = ROOT / app / "pyproject.toml"
    assert rewrite_app_config(path) == path.read_text()


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ConfigError, match="^3 problems: ") as caught:
        RunConfig.from_mapping({"lr": 0, "batch-size": 0, "alpha": -1})
    for problem in ("lr must be > 0", "batch-size must be > 0", "alpha must be a finite number"):
        assert problem in caught.value.reason


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"strategy": "fetchsgd", "server-momentum": 0.9}, "sketch-momentum"),
        ({"strategy": "sketched-sgd", "server-momentum": 0.9}, "step-momentum"),
        ({"sketch-momentum": 0.9}, "sketch-momentum shapes .* 'fetchsgd', not 'local-sgd'"),
        ({"strategy": "fetchsgd", "step-momentum": 0.9}, "step-momentum shapes"),
        ({"strategy": "fetchsgd", "sketch-momentum": 1.0}, r"sketch-momentum must be in \[0, 1\)"),
    ],
)
def test_each_strategy_names_its_own_momentum(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


def test_round_trip_through_run_config() -> None:
    config = RunConfig.from_mapping({"sites": "a,b,c", "alpha": 0.1, "local-steps": 5})
    assert config.sites == ("a", "b", "c")
    assert RunConfig.from_mapping(config.to_run_config()) == config


@pytest.mark.parametrize("count", [6, "6", " 6 "])
def test_a_count_of_sites_means_that_many_sites_as_on_the_command_line(count: object) -> None:
    # `flwr run --run-config sites=6` and `flplatform simulate --sites 6` mean the same
    config = RunConfig.from_mapping({"sites": count})
    assert config.sites == ("london", "ohio", "california", "tokyo", "site-5", "site-6")
    assert RunConfig.from_mapping(config.to_run_config()) == config


def test_strategy_aliases_name_one_algorithm() -> None:
    assert RunConfig.from_mapping({"strategy": "fedavg"}).strategy == "local-sgd"
    assert RunConfig.from_mapping({"strategy": "dts"}).strategy == "delayed"


def test_diloco_is_local_sgd_with_a_nesterov_outer_step() -> None:
    from flplatform.app.federation import build_strategy

    config = RunConfig.from_mapping(
        {"strategy": "diloco", "server-nesterov": "true", "server-momentum": 0.9, "server-lr": 0.7}
    )
    assert config.strategy == "local-sgd"
    strategy = build_strategy(config)
    assert (strategy.eta, strategy.beta, strategy.nesterov) == (0.7, 0.9, True)
    assert not build_strategy(RunConfig()).nesterov


def test_the_period_sets_the_local_steps_of_delayed_updates() -> None:
    from flplatform.app.federation import build_policy, build_strategy, train_config_for

    config = RunConfig.from_mapping(
        {"strategy": "delayed", "delay": 3, "period": 20, "compensation": False}
    )
    assert train_config_for(config)["local-steps"] == 20
    strategy = build_strategy(config)
    assert (strategy.delay, strategy.compensate) == (3, False)
    assert build_policy(config).pipelined
    assert not build_policy(RunConfig()).pipelined


def test_streaming_diloco_is_delayed_updates_with_fragments_and_an_outer_nesterov_step() -> None:
    from flplatform.app.federation import build_strategy

    config = RunConfig.from_mapping(
        {
            "strategy": "delayed",
            "delay": 1,
            "fragments": 4,
            "codec": "int4",
            "server-momentum": 0.9,
            "server-nesterov": "true",
            "server-lr": 0.7,
        }
    )
    strategy = build_strategy(config)
    assert (strategy.delay, strategy.fragments, strategy.codec.name) == (1, 4, "int4")
    assert (strategy.eta, strategy.beta, strategy.nesterov) == (0.7, 0.9, True)
    assert build_strategy(RunConfig.from_mapping({"strategy": "delayed"})).fragments == 1


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"strategy": "magic"},
            "unknown strategy 'magic'; allowed: delayed, dga, diloco, dts, fedavg, fedavgm, "
            "fetchsgd, local-sgd, sketched-sgd",
        ),
        ({"model": "vgg"}, "unknown model 'vgg'; allowed: mlp, cnn"),
        ({"dataset": "imagenet"}, "unknown dataset 'imagenet'; allowed: digits, mnist5k"),
        ({"partition": "zipf"}, "unknown partition 'zipf'; allowed: iid, dirichlet"),
        ({"alpha": 0}, "alpha must be a finite number > 0"),
        ({"alpha": -1.5}, "alpha must be a finite number > 0"),
        ({"num-server-rounds": 0}, "num-server-rounds must be > 0"),
        ({"num-server-rounds": "three"}, "num-server-rounds must be an integer"),
        ({"batch-size": -2}, "batch-size must be > 0"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"fraction-train": 0.0}, r"fraction-train must be in \(0, 1\]"),
        ({"local-steps": 0, "local-epochs": 0}, "set local-steps"),
        ({"sites": "a,a"}, "duplicate names"),
        ({"sites": "ok,../etc"}, "bad site name"),
        ({"sites": 0}, "sites must be a positive count or a list of names, got 0"),
        ({"sites": "-3"}, "sites must be a positive count or a list of names, got -3"),
        ({"sites": True}, "sites must be a positive count or a list of names, got True"),
        ({"sites": "a,7"}, "site name '7' in sites is only digits, which reads as a count"),
        ({"no-such-key": 1}, "unknown config key 'no-such-key'"),
        ({"strategy": "fedavgm"}, "fedavgm needs server-momentum > 0"),
        ({"round-timeout": 1e12}, "round-timeout must be at most"),
        (
            {"max-failed-rounds": -1},
            r"max-failed-rounds must be an integer >= 0 \(0: never stop\), got -1",
        ),
        ({"max-failed-rounds": 2.5}, "max-failed-rounds must be an integer"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),  # the sites refuse it too
        ({"delay": 3}, "delay shape delayed compensated updates: use them with strategy"),
        ({"period": 20, "compensation": False}, "period, compensation shape delayed"),
        ({"strategy": "delayed", "delay": -1}, "delay must be an integer >= 0"),
        ({"strategy": "delayed", "period": -5}, "period must be >= 0"),
        ({"strategy": "delayed", "sync": "k-sync"}, "runs with sync mode 'sync' only"),
        (
            {"strategy": "fetchsgd", "k": 50, "server-nesterov": True},
            r"^server-nesterov shapes the server momentum \(server-momentum\) of strategies "
            "local-sgd and delayed, which strategy 'fetchsgd' does not use: leave "
            "server-nesterov at its default$",
        ),
        ({"strategy": "delayed", "server-nesterov": True}, "server-nesterov needs server-mom"),
        ({"strategy": "delayed", "fragments": 0}, "fragments must be >= 1"),
        ({"strategy": "delayed", "fragments": 2, "compensation": False}, "needs compensation"),
        ({"fragments": 4}, "fragments shape delayed compensated updates: use them with"),
        ({"server-nesterov": True}, "server-nesterov needs server-momentum > 0"),
        ({"strategy": "diloco", "server-momentum": 0.9}, "set server-nesterov true"),
        (
            {"server-momentum-every": 2, "server-momentum": 0.9},
            "server-momentum-every > 1 is delayed Nesterov: set server-nesterov true",
        ),
        ({"server-momentum-every": 0}, "server-momentum-every must be an integer >= 1, got 0"),
        (
            {"strategy": "delayed", "server-momentum-every": 2},
            r"^server-momentum-every is local-sgd's delayed Nesterov momentum \(for its "
            r"asynchronous modes\); strategy 'delayed' does not use it: leave "
            "server-momentum-every at its default$",
        ),
        ({"strategy": "delayed", "fraction-train": 0.5}, "fraction-train must be 1"),
        ({"standardize-features": True}, "standardize-features .* set fraction-evaluate > 0"),
        ({"standardize-features": "perhaps"}, "standardize-features must be true or false"),
    ],
)
def test_bad_values_name_the_problem(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(0, 1, "london") == derive_seed(0, 1, "london")
    assert len({derive_seed(0, r, s) for r in range(5) for s in ("a", "b")}) == 10
    assert rng_for(3, "x").integers(1 << 30) == rng_for(3, "x").integers(1 << 30)


def test_batch_modes_refuse_a_sampling_fraction() -> None:
    from flplatform.app.config import RunConfig
    from flplatform.core.errors import ConfigError

    with pytest.raises(ConfigError, match="concurrency instead"):
        RunConfig.from_mapping({"sync": "k-batch-async", "fraction-train": 0.5})
    assert RunConfig.from_mapping({"sync": "k-async", "fraction-train": 0.5}).sync == "k-async"


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"aggregator": "median", "sync": "async"},
            "combines one update, whose median is the update",
        ),
        ({"aggregator": "median", "sites": "a,b"}, "at most 2 updates, whose median is their mean"),
        ({"aggregator": "median", "fraction-train": 0.5}, "at most 2 updates"),  # 2 of 4
        ({"aggregator": "median", "sync": "k-sync", "k": 2}, "at most 2 updates"),
        ({"aggregator": "trimmed-mean"}, r"int\(0.2 x 4\) = 0 .* at least 0.25,"),
        ({"aggregator": "trimmed-mean", "sites": "a,b,c"}, "at least 0.334,"),
        (
            {"aggregator": "trimmed-mean", "sites": "a,b", "trim-fraction": 0.4},
            "the plain mean; use",
        ),
    ],
)
def test_a_robust_aggregator_that_could_outvote_no_one_is_refused(
    values: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


@pytest.mark.parametrize(
    "values",
    [
        {"aggregator": "median"},  # 4 sites
        {"aggregator": "median", "sync": "k-batch-async", "k": 3},
        {"aggregator": "median", "sync": "k-sync", "k": 2, "adasync": True},  # K grows
        {"aggregator": "trimmed-mean", "trim-fraction": 0.25},
        {"aggregator": "trimmed-mean", "sites": "a,b,c", "trim-fraction": 0.334},
        {"aggregator": "trimmed-mean", "sites": "a,b", "trim-fraction": 0},  # the mean, asked
        {"aggregator": "centered-clip", "sync": "async"},
    ],
)
def test_a_robust_aggregator_that_cuts_is_accepted(values: dict) -> None:
    RunConfig.from_mapping(values)


def test_max_failed_rounds_reaches_the_run_config() -> None:
    """The stop rule's knob: 3 by default, 0 (never stop) allowed, passed on to Flower."""
    assert RunConfig().max_failed_rounds == 3
    config = RunConfig.from_mapping({"max-failed-rounds": 0})
    assert config.max_failed_rounds == 0
    assert config.to_run_config()["max-failed-rounds"] == 0
    assert RunConfig.from_mapping(config.to_run_config()) == config


# ------------------------------------------------ a user's model and an app's own keys
def test_model_accepts_an_importable_factory_spec(tmp_path: Path, monkeypatch) -> None:
    name = f"cfg_model_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "from torch import nn\n\n"
        "def Net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n\n"
        "def text():\n    return 'no model'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig.from_mapping({"model": f"{name}:Net"})
    assert config.model == f"{name}:Net"
    assert RunConfig.from_mapping(config.to_run_config()) == config
    with pytest.raises(ConfigError, match="returned a str, not a torch.nn.Module"):
        RunConfig.from_mapping({"model": f"{name}:text"})
    with pytest.raises(ConfigError, match=f"module '{name}' has no 'Missing'"):
        RunConfig.from_mapping({"model": f"{name}:Missing"})


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("vgg", r"unknown model 'vgg'; allowed: mlp, cnn, wide-mlp, resnet, or MODULE:FACTORY"),
        ("no_such_pkg_q.models:Net", "no module named 'no_such_pkg_q.models'"),
        ("mod:", "is not MODULE:FACTORY"),
    ],
)
def test_a_bad_model_is_refused_at_the_edge(model: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping({"model": model})


def test_allow_unknown_skips_an_apps_own_keys() -> None:
    values = {"lr": 0.2, "learning-rate": 0.05, "my.nested-key": "x"}
    with pytest.raises(ConfigError, match="unknown config key 'learning-rate'"):
        RunConfig.from_mapping(values)
    config = RunConfig.from_mapping(values, allow_unknown=True)
    assert config.lr == 0.2 and config == RunConfig.from_mapping({"lr": 0.2})
    assert RunConfig.unknown_keys(values) == ["learning-rate", "my.nested-key"]
    assert RunConfig.unknown_keys(RunConfig().to_run_config()) == []
    # Our own keys are still checked.
    with pytest.raises(ConfigError, match="lr must be > 0"):
        RunConfig.from_mapping({"lr": 0, "learning-rate": 1}, allow_unknown=True)
