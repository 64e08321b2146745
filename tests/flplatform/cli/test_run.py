"""``flplatform run APP_DIR``: a user's own Flower app with the platform's options.

Bad input is one line before Flower starts; tests/integration/test_own_app.py runs the app.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError
from flplatform.launch.app_directory import (
    RunOverrides,
    options_environment,
    plan_run,
    read_app,
    relaunch,
)
from flplatform.run.options import OPTIONS_ENV, options_from_environment
from storage.session import PASSWORD_ENV, PASSWORD_FILE_ENV, split_password
from tests.helpers.cli import invoke, one_error_line

ROOT = Path(__file__).resolve().parents[3]
NETWORK_FILE = "two-labs.toml"  # a profile of examples/networks
OWN_APP = ROOT / "examples" / "own_app"
PLAIN_APP = ROOT / "examples" / "plain_flower_client"


def write_app(directory: Path, pyproject: str, modules: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(pyproject)
    for name, text in (modules or {}).items():
        (directory / name).write_text(text)
    return directory


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
learning-rate = 0.1
use-bn = true
label = "x"
"""
TINY_MODULES = {"tiny_server.py": "app = None\n", "tiny_client.py": "app = None\n"}


# ============================================================ errors, before any start-up
@pytest.mark.usefixtures("flplatform_home")
def test_a_missing_app_directory_is_one_line(tmp_path: Path) -> None:
    result = invoke(["run", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert (
        one_error_line(result.output)
        == f"error: app directory {tmp_path / 'nowhere'} does not exist"
    )


@pytest.mark.usefixtures("flplatform_home")
def test_a_file_is_not_an_app_directory(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("")
    result = invoke(["run", str(tmp_path / "app.py")])
    assert result.exit_code == 2
    assert "is not a directory" in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_a_directory_without_pyproject_is_one_line(tmp_path: Path) -> None:
    result = invoke(["run", str(tmp_path)])
    assert result.exit_code == 2
    assert "has no pyproject.toml" in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_a_pyproject_without_flower_app_is_one_line(tmp_path: Path) -> None:
    write_app(tmp_path, '[project]\nname = "lib"\nversion = "1"\n')
    result = invoke(["run", str(tmp_path)])
    assert result.exit_code == 2
    assert "has no tool.flwr.app table: not a Flower app" in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_a_component_that_is_not_there_is_flowers_reason(tmp_path: Path) -> None:
    write_app(tmp_path, TINY_APP, {"tiny_server.py": "app = None\n"})  # no tiny_client.py
    result = invoke(["run", str(tmp_path)])
    assert result.exit_code == 2
    assert "Unable to load module tiny_client" in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    write_app(tmp_path, "[project\nname=")
    result = invoke(["run", str(tmp_path)])
    assert result.exit_code == 2
    assert "cannot read" in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["-c", "lr=0.1"],
            "-c lr: app 'tiny-app' declares no run-config key 'lr'; its keys: label, "
            "learning-rate, num-server-rounds, use-bn",
        ),
        (["-c", "learning-rate"], "expected key=value"),
        (["-c", "learning-rate=fast"], "-c learning-rate must be a number (declared 0.1)"),
        (["-c", "num-server-rounds=2.5"], "-c num-server-rounds must be an integer"),
        (["-c", "use-bn=maybe"], "-c use-bn must be true or false"),
        (["--rounds", "0"], "--rounds must be an integer >= 1"),
        (["--rounds", "2", "-c", "num-server-rounds=3"], "--rounds and -c num-server-rounds"),
        (["--sites", "0"], "--sites must be a positive count"),
        (["--sites", "a,a"], "duplicate names"),
        (["--k", "0"], "--k must be an integer >= 1"),
        (["--seed", "-1"], "--seed must be an integer >= 0"),
        (["--max-failed-rounds", "-1"], "--max-failed-rounds must be an integer >= 0"),
        (["--sync", "eventually"], "unknown --sync 'eventually'; allowed: sync, k-sync"),
        (["--network", "mars"], "mars"),
        (["--network", "/nonexistent/net.toml"], "/nonexistent/net.toml"),
        (["--db", "nosuchdriver://x/y"], "cannot open database"),
        (
            ["--strategy", "fetchsgd"],
            "--strategy sets the app's 'strategy' run-config key, which app 'tiny-app' does "
            "not declare",
        ),
        (["--model", "mlp"], "--model sets the app's 'model' run-config key"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    write_app(tmp_path / "tiny", TINY_APP, TINY_MODULES)
    result = invoke(["run", str(tmp_path / "tiny"), *args])
    assert result.exit_code in (2, 4), result.output
    assert expected in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("vgg", "unknown --model 'vgg'; allowed: mlp, cnn, wide-mlp, resnet, or MODULE:FACTORY"),
        ("nosuchmodule_r:Net", "no module named 'nosuchmodule_r'"),
        ("plain_client:load_partition", "calling it with no arguments failed: TypeError"),
        ("plain_client:app", "returned a Message|not a torch.nn.Module|calling it"),
        ("plain_client:Missing", "module 'plain_client' has no 'Missing'"),
    ],
)
def test_a_bad_model_spec_is_one_line(model: str, expected: str) -> None:
    """flplatform's generic ServerApp (plain_flower_client's) builds --model; the app
    directory is importable, as it is in Flower's processes."""
    import re

    result = invoke(["run", str(PLAIN_APP), "--model", model])
    assert result.exit_code == 2
    assert re.search(expected, one_error_line(result.output))


@pytest.mark.usefixtures("flplatform_home")
def test_the_generic_serverapp_checks_its_run_config_up_front() -> None:
    result = invoke(["run", str(PLAIN_APP), "--strategy", "magic"])
    assert result.exit_code == 2
    assert "unknown strategy 'magic'" in one_error_line(result.output)
    result = invoke(["run", str(PLAIN_APP), "-c", "strategy=delayed", "--sync", "k-async"])
    assert "runs with sync mode 'sync' only" in one_error_line(result.output)
    # Where the run is recorded and its tag are flplatform run's, to follow it.
    result = invoke(["run", str(PLAIN_APP), "-c", "db=sqlite:///x.db"])
    assert one_error_line(result.output) == "error: -c db: use --db"
    result = invoke(["run", str(PLAIN_APP), "-c", "run-tag=mine"])
    assert "-c run-tag: flplatform run sets it" in one_error_line(result.output)
    # A sweep's members are runs of their own, which the command would not follow: it
    # would stop the simulation when the first one ends.
    result = invoke(["run", str(PLAIN_APP), "-c", 'sweep=\'[{"seed": 1}, {"seed": 2}]\''])
    assert result.exit_code == 2
    assert "-c sweep: flplatform run follows one run" in one_error_line(result.output)


# ============================================================== what reaches the app
@pytest.mark.usefixtures("flplatform_home")
def test_only_given_options_are_sent(tmp_path: Path) -> None:
    tiny = read_app(write_app(tmp_path / "tiny", TINY_APP, TINY_MODULES))
    plan = plan_run(tiny, RunOverrides(), tag="t1")
    # Nothing given: the app's own config as declared; start() told only where to record.
    assert plan.run_config == {}
    assert set(plan.options) == {"ledger", "tag", "launched_by", "required_sites"}
    assert plan.options["tag"] == "t1"
    assert plan.options["required_sites"] == 2  # the SuperNodes the simulation starts
    launched = {"app": str(tiny.path), "cwd": str(Path.cwd()), "options": {}}
    assert plan.options["launched_by"] == launched
    assert plan.num_sites == 2 and plan.num_rounds == 3

    given = RunOverrides(
        sites=("a", "b", "c"),
        rounds=4,
        sync="k-async",
        k=2,
        network="world",
        seed=7,
        max_failed_rounds=0,
        run_config=("learning-rate=0.01", "label='y z'", "use-bn=false"),
    )
    plan = plan_run(tiny, given, tag="t2")
    assert plan.run_config == {
        "learning-rate": 0.01,
        "label": "y z",
        "use-bn": False,
        "num-server-rounds": 4,
    }
    assert plan.num_sites == 3 and plan.num_rounds == 4
    env = plan.environment()
    assert set(env) == {OPTIONS_ENV}
    sent = json.loads(env[OPTIONS_ENV])
    assert sent == {
        "num_rounds": 4,
        "sync": "k-async",
        "k": 2,
        "network": "world",
        "seed": 7,
        "max_failed_rounds": 0,
        "required_sites": 3,
        "ledger": plan.db_url,
        "tag": "t2",
        # recorded with the run: how `flplatform resume` launches it again
        "launched_by": {
            "app": str(tiny.path),
            "cwd": str(Path.cwd()),
            "options": {
                "sites": ["a", "b", "c"],
                "rounds": 4,
                "sync": "k-async",
                "k": 2,
                "network": "world",
                "seed": 7,
                "max_failed_rounds": 0,
                "run_config": ["learning-rate=0.01", "label='y z'", "use-bn=false"],
            },
        },
    }
    # ... and start() in the ServerApp reads back exactly that.
    assert options_from_environment(env) == sent
    assert options_environment({"k": 3}) == {OPTIONS_ENV: '{"k": 3}'}


FEDERATIONS = """
[tool.flwr.federations]
default = "local-simulation"

[tool.flwr.federations.local-simulation]
options.num-supernodes = {count}

[tool.flwr.federations.remote]
address = "127.0.0.1:9093"
insecure = true
"""


@pytest.mark.usefixtures("flplatform_home")
def test_the_apps_federation_says_how_many_sites_as_flwr_run_reads_it(tmp_path: Path) -> None:
    """An app written before Flower 1.41 declares its simulation's size in its default
    federation: ``flwr run`` simulates that many SuperNodes, and so does ``flplatform run``
    unless --sites says otherwise."""
    app = read_app(
        write_app(tmp_path / "fed", TINY_APP + FEDERATIONS.format(count=5), TINY_MODULES)
    )
    assert app.num_supernodes == 5
    plan = plan_run(app, RunOverrides(), tag="t1")
    assert plan.site_names == ("site-1", "site-2", "site-3", "site-4", "site-5")
    assert plan.options["required_sites"] == 5
    assert plan_run(app, RunOverrides(sites=("a", "b")), tag="t2").num_sites == 2
    # a default federation of a SuperLink's address simulates nothing: Flower's 2
    remote = TINY_APP + FEDERATIONS.format(count=5).replace('"local-simulation"\n', '"remote"\n')
    app = read_app(write_app(tmp_path / "remote", remote, TINY_MODULES))
    assert app.num_supernodes is None
    assert plan_run(app, RunOverrides(), tag="t3").num_sites == 2


@pytest.mark.usefixtures("flplatform_home")
@pytest.mark.parametrize("count", ["0", '"three"', "true", "2.5"])
def test_a_federation_of_no_whole_number_of_supernodes_is_one_line(
    tmp_path: Path, count: str
) -> None:
    write_app(tmp_path / "fed", TINY_APP + FEDERATIONS.format(count=count), TINY_MODULES)
    result = invoke(["run", str(tmp_path / "fed")])
    assert result.exit_code == 2, result.output
    assert (
        "[tool.flwr.federations.local-simulation] options.num-supernodes must be a whole "
        "number >= 1"
    ) in one_error_line(result.output)


@pytest.mark.usefixtures("flplatform_home")
def test_the_generic_serverapp_gets_its_own_keys(tmp_path: Path) -> None:
    plain = read_app(PLAIN_APP)
    assert plain.uses_generic_serverapp
    db = f"sqlite:///{tmp_path / 'l.db'}"
    plan = plan_run(
        plain,
        RunOverrides(sites=("x", "y"), rounds=2, strategy="fedavg", db=db, k=3),
        tag="t3",
    )
    assert plan.run_config == {
        "sites": "x,y",
        "num-server-rounds": 2,
        "strategy": "fedavg",
        "k": 3,
        "db": db,
        "run-tag": "t3",
    }
    # Its declared sites decide the number of SuperNodes when --sites is not given.
    assert plan_run(plain, RunOverrides(), tag="t4").site_names == (
        "london",
        "ohio",
        "california",
        "tokyo",
    )
    # A count, as text or a number, means as many sites to the launcher as to the
    # generic ServerApp (RunConfig.sites), which waits for one node per name.
    for count in ("6", 6):
        plan = plan_run(plain, RunOverrides(run_config=(f"sites={count!r}",)), tag="t5")
        assert plan.site_names == RunConfig.from_mapping({"sites": count}).sites
        assert len(plan.site_names) == 6


@pytest.mark.postgres
@pytest.mark.usefixtures("flplatform_home")
def test_the_ledger_password_reaches_the_app_in_a_password_file_only(
    password_database: str,
) -> None:
    public, password = split_password(password_database)
    assert password
    plan = plan_run(read_app(PLAIN_APP), RunOverrides(db=password_database), tag="t5")

    assert plan.db_url == password_database  # this process follows the run with it
    assert plan.run_config["db"] == public  # Flower's run config, stored by the SuperLink
    env = plan.environment()
    assert json.loads(env[OPTIONS_ENV])["ledger"] == public
    assert [key for key, value in env.items() if password in value] == []
    assert PASSWORD_ENV not in env
    assert Path(env[PASSWORD_FILE_ENV]).read_text().endswith(f":{password}\n")
    assert "db" not in plan.options["launched_by"]["options"]  # recorded with the run


@pytest.mark.usefixtures("flplatform_home")
def test_a_recorded_launch_plans_the_same_run_again_to_resume_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = read_app(write_app(tmp_path / "tiny", TINY_APP, TINY_MODULES))
    started_in = tmp_path / "project"
    started_in.mkdir()
    shutil.copy(ROOT / "examples" / "networks" / NETWORK_FILE, started_in / "links.toml")
    monkeypatch.chdir(started_in)
    given = RunOverrides(
        sites=("a", "b"),
        rounds=5,
        sync="k-async",
        k=2,
        network="links.toml",  # relative, like the next two: as meant where it started
        checkpoint_every=2,
        keep_checkpoints=4,
        checkpoint_dir="ckpt",
        run_config=("learning-rate=0.01",),
        db="sqlite:///ledger.db",
    )
    first = plan_run(tiny, given, tag="t7")
    assert first.options["checkpoint_every"] == 2 and first.options["keep_checkpoints"] == 4
    assert first.options["checkpoint_dir"] == str(started_in / "ckpt")
    assert first.options["network"] == str(started_in / "links.toml")
    # Through the ledger's JSON, as `flplatform resume` reads it back, from elsewhere.
    launch = json.loads(json.dumps(first.options["launched_by"]))
    monkeypatch.chdir(tmp_path)

    again = relaunch(launch, run_id=9, db=first.db_url, tag="t7")

    assert again.options == {**first.options, "resume_run": 9}
    assert again.run_config == first.run_config and again.site_names == first.site_names
    assert again.app == first.app and again.db_url == first.db_url
    # The directory it started in is gone: refused, not read against another one.
    with pytest.raises(ConfigError, match="the directory it was started from"):
        relaunch({**launch, "cwd": str(tmp_path / "gone")}, run_id=9, db=None, tag="t7")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--checkpoint-every", "-1"], "--checkpoint-every must be an integer >= 0"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer >= 1"),
    ],
)
@pytest.mark.usefixtures("flplatform_home")
def test_bad_checkpoint_options_are_one_line(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    tiny = write_app(tmp_path / "tiny", TINY_APP, TINY_MODULES)
    result = invoke(["run", str(tiny), *args])
    assert result.exit_code == 2
    assert expected in one_error_line(result.output)


def test_the_own_app_example_is_a_valid_flower_app() -> None:
    own = read_app(OWN_APP)
    assert own.serverapp == "own_app.server_app:app" and not own.uses_generic_serverapp
    assert {"num-server-rounds", "strategy", "learning-rate", "seed"} <= set(own.config)
    # Its own keys only: none of the platform's (start() gets those from FLPLATFORM_OPTIONS).
    assert not {"sync", "network", "db", "run-tag", "k"} & set(own.config)


def test_reading_an_app_leaves_no_import_behind_for_the_next_app_of_its_name(
    tmp_path: Path,
) -> None:
    """Flower's check of the components imports their package (finding a submodule
    imports its parent); a package of the same name read before, from another directory
    since removed, made the next app's check fail ("Unable to load module"), in a
    process reading two copies of an app (a sweep, a notebook, the test suite)."""
    import sys

    first = tmp_path / "copy"
    shutil.copytree(OWN_APP, first, ignore=shutil.ignore_patterns("__pycache__"))
    before = {name for name in sys.modules if name.split(".")[0] == "own_app"}
    assert read_app(first).serverapp == "own_app.server_app:app"
    assert {name for name in sys.modules if name.split(".")[0] == "own_app"} == before
    shutil.rmtree(first)
    assert read_app(OWN_APP).serverapp == "own_app.server_app:app"
    # an app already imported (the user's own process) keeps its modules
    sys.path.insert(0, str(OWN_APP))
    try:
        import own_app  # type: ignore[import-not-found]

        read_app(OWN_APP)
        assert sys.modules["own_app"] is own_app
    finally:
        sys.path.remove(str(OWN_APP))
        for name in [n for n in sys.modules if n.split(".")[0] == "own_app"]:
            del sys.modules[name]


def test_every_override_goes_to_a_start_option_or_a_key_the_table_knows() -> None:
    """RunOverrides is the one list of `flplatform run`'s options: each start() keyword it
    sets is one of start()'s, and each of the guard's options is among them."""
    from dataclasses import fields

    from flplatform.engine.guard import GUARD_OPTIONS
    from flplatform.launch.app_directory import RUN_CONFIG_KEYS, START_KEYWORDS
    from flplatform.run.options import OPTION_NAMES

    assert set(START_KEYWORDS.values()) <= set(OPTION_NAMES)
    assert set(GUARD_OPTIONS) <= set(START_KEYWORDS) <= set(RUN_CONFIG_KEYS)
    assert {"db", "run_config"}.isdisjoint(RUN_CONFIG_KEYS)
    assert set(RUN_CONFIG_KEYS) | {"db", "run_config"} == {f.name for f in fields(RunOverrides)}
    assert (RUN_CONFIG_KEYS["rounds"], START_KEYWORDS["rounds"]) == (
        "num-server-rounds",
        "num_rounds",
    )
