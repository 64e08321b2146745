"""``flplatform.start``: the platform's parts around any strategy, and its CLI overrides.

The real round engine, the real SQL ledger and Flower's real strategies run here; only
the transport is the in-process ``ScriptedGrid``, whose sites reply as ClientApps do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg, Result

from flplatform.app.comparison import run_setup
from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import ConfigError, DataError, NoProgress, UpdateRejected
from flplatform.engine import APPLIED, REJECTED, RoundSummary, Synchrony
from flplatform.engine.engine import RoundEngine
from flplatform.run.flower_adapter import FlowerStrategyAdapter
from flplatform.run.options import (
    OPTION_NAMES,
    OPTIONS_ENV,
    PlatformOptions,
    options_from_environment,
)
from flplatform.run.owner import OWNER_ENV, owner_token
from flplatform.run.run_record import LAUNCH_KEY, record_failed_start
from flplatform.run.start import options_environment, start
from storage import LedgerRepository
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import Behaviour, FlowerGrid, ScriptedGrid
from tests.helpers.sites import MODEL, Reply, digits_model, replying_site, trained

pytestmark = pytest.mark.usefixtures("task_identity")


def two_sites() -> dict[int, Behaviour]:
    return {
        1: replying_site("a", trained(1.0, examples=10, loss=1.0)),
        2: replying_site("b", trained(4.0, examples=30, loss=0.0)),
    }


# (10·1 + 30·4) / 40: the example-weighted mean of the two sites' models, by hand.
WEIGHTED_MEAN = (10 * 1.0 + 30 * 4.0) / 40


@pytest.fixture
def db(sqlite_ledger: str) -> str:
    return sqlite_ledger


@pytest.fixture(autouse=True)
def no_cli_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPTIONS_ENV, raising=False)


def model_of(result_arrays: ArrayRecord) -> np.ndarray:
    return record_to_arrays(result_arrays)["w"]


# ====================================================================== the ledger
def test_start_records_the_run_its_rounds_and_updates(db: str) -> None:
    seen: list[RoundSummary] = []
    result = start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=2,
        ledger=db,
        tag="t-1",
        seed=7,
        on_round=seen.append,
        reject_replays=False,  # the scripted sites send the same model every round
    )
    np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)
    assert [s.server_round for s in seen] == [1, 2]
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.strategy, run.name, run.tag) == (
            "finished",
            "local-sgd",
            "local-sgd",
            "t-1",
        )
        assert (run.seed, run.num_rounds_planned, run.network) == (7, 2, None)
        # Without a run_config, the options that shaped the run are recorded.
        assert run.config["sync"] == "sync" and run.config["num-server-rounds"] == 2
        rounds = repo.list_rounds(run.id)
        assert [(r.round, r.model_version, r.num_applied) for r in rounds] == [(1, 1, 2), (2, 2, 2)]
        assert rounds[0].train_loss == pytest.approx(0.25)  # (10·1 + 30·0) / 40
        updates = repo.list_updates(run.id)
        assert sorted((u.site, u.round, u.status) for u in updates) == [
            ("a", 1, APPLIED),
            ("a", 2, APPLIED),
            ("b", 1, APPLIED),
            ("b", 2, APPLIED),
        ]


def test_on_a_deployment_a_silent_site_is_named_after_the_query_deadline(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `flplatform server` (DEPLOYMENT_ENV), a connected site that answers nothing
    is named once the deployment's query deadline passes, and the run trains without it
    (tests/flplatform/engine/test_silent_sites.py has the engine's side)."""
    import flplatform.run.start as start_module
    from flplatform.engine.events import SITE_SILENT_EVENT
    from flplatform.run.run_record import DEPLOYMENT_ENV

    monkeypatch.setattr(start_module, "DEPLOYED_QUERY_SECONDS", 0.2)
    monkeypatch.setenv(DEPLOYMENT_ENV, json.dumps({"deployment": "ca-0123456789ab"}))
    sites = {**two_sites(), 3: lambda msg: None}  # its SuperNode runs no ClientApp
    start(
        LocalSGDAveraging(),
        ScriptedGrid(sites),
        MODEL,
        num_rounds=2,
        ledger=db,
        reject_replays=False,  # the scripted sites send the same model every round
    )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        silent = [e.detail for e in repo.list_events(run.id) if e.kind == SITE_SILENT_EVENT]
        rounds = repo.list_rounds(run.id)
    assert run.status == "finished"
    assert [(d["site"], d["waited"]) for d in silent] == [("node-3", 0.2)]
    assert [r.num_applied for r in rounds] == [2, 2]


@pytest.mark.parametrize("wait", [1.5, 0, -1, True, "60", float("inf")], ids=str)
def test_on_a_deployment_a_silent_registered_site_is_waited_for_its_wait_timeout(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: object
) -> None:
    """`flplatform server --wait-timeout` reaches the ServerApp (DEPLOYMENT_ENV): a
    registered site silent at start-up is waited for that long before the run goes on
    without it; a value the server would not write is refused before anything starts."""
    import flplatform.run.start as start_module
    from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry
    from flplatform.run.run_record import DEPLOYMENT_ENV

    monkeypatch.setattr(start_module, "DEPLOYED_QUERY_SECONDS", 0.2)
    deployment = {"deployment": "ca-0123456789ab", "wait-timeout": wait}
    monkeypatch.setenv(DEPLOYMENT_ENV, json.dumps(deployment))
    registry = tmp_path / "registry.json"
    SiteRegistry(tuple(RegisteredSite(n, i, f"SHA256:{n}") for n, i in (("a", 1), ("c", 3)))).write(
        registry
    )
    monkeypatch.setenv(REGISTRY_ENV, str(registry))
    sites = {1: two_sites()[1], 3: lambda msg: None}  # c's SuperNode runs no ClientApp

    def run() -> None:
        start(LocalSGDAveraging(), ScriptedGrid(sites), MODEL, num_rounds=1, ledger=db)

    if wait != 1.5:
        with pytest.raises(ConfigError, match="wait-timeout > 0 in seconds"):
            run()
        return
    started = time.monotonic()
    run()
    assert 1.5 <= time.monotonic() - started < 60  # its wait, not the engine's 300 s
    with LedgerRepository.open(db) as repo:
        (record,) = repo.list_runs()
        assert record.status == "finished"
        assert [r.num_applied for r in repo.list_rounds(record.id)] == [1]


def test_checkpoint_every_zero_keeps_only_the_final_model(db: str, tmp_path: Path) -> None:
    start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=6,
        ledger=db,
        checkpoint_every=0,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        reject_replays=False,
    )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished"
        assert [(c.round, c.kept) for c in repo.list_checkpoints(run.id)] == [(6, True)]


def test_the_package_call_runs_without_a_ledger(flplatform_home: Path) -> None:
    import flplatform

    result = flplatform.start(LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, num_rounds=1)
    np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)
    assert not (flplatform_home / "ledger.db").exists()


def test_a_run_that_stops_early_is_recorded_failed_with_the_reason(db: str) -> None:
    def no_weight(msg: Message, sent: np.ndarray) -> RecordDict:
        arrays = ArrayRecord({"w": Array(np.ones_like(sent))})
        return RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord({"loss": 1.0})})

    grid = ScriptedGrid({1: replying_site("a", no_weight), 2: replying_site("b", no_weight)})
    with pytest.raises(NoProgress) as raised:
        start(LocalSGDAveraging(), grid, MODEL, num_rounds=5, ledger=db, max_failed_rounds=2)
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "failed"
        assert run.error == raised.value.reason
        assert "num-examples" in (run.error or "")
        assert len(repo.list_rounds(run.id)) == 2  # stopped after two such rounds


@pytest.mark.skipif(owner_token() is None, reason="names its owner through /proc (Linux)")
@pytest.mark.parametrize("owned", [True, False], ids=["owned", "flwr-run"])
@pytest.mark.parametrize(
    "stop", [KeyboardInterrupt, lambda: SystemExit(0)], ids=["SIGINT", "flower-exit"]
)
def test_a_serverapp_interrupted_while_its_command_lives_leaves_the_stop_to_the_command(
    db: str, owned: bool, stop: Callable[[], BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command that started the run stops its processes, then marks the run with the
    signal's name. The ServerApp, interrupted meanwhile, wrote "KeyboardInterrupt: "
    (a simulation's) or "SystemExit: 0" (a deployed one's: Flower's flwr-serverapp exits
    on SIGTERM) first when it was quick, and that text stayed. With no owning command
    (`flwr run`), the ServerApp still records its own interruption."""
    if owned:
        monkeypatch.setenv(OWNER_ENV, owner_token() or "")
    else:
        monkeypatch.delenv(OWNER_ENV, raising=False)
    sent = 0

    def interrupted_in_round_2(msg: Message, model: np.ndarray) -> RecordDict:
        nonlocal sent
        sent += 1
        if sent > 2:  # the signal lands while round 2's replies are pulled
            raise stop()
        return trained(1.0, 10, 0.5)(msg, model)

    grid = ScriptedGrid(
        {
            1: replying_site("a", interrupted_in_round_2),
            2: replying_site("b", trained(1.0, 10, 0.5)),
        }
    )
    with pytest.raises((KeyboardInterrupt, SystemExit)) as raised:
        start(LocalSGDAveraging(), grid, MODEL, num_rounds=5, ledger=db)
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
    if owned:  # left for the command, which marks it once every process is gone
        assert run.status == "running" and run.error is None
    else:
        assert run.status == "failed"
        assert (run.error or "").startswith(type(raised.value).__name__)


# ====================================================================== should_stop
def _accuracy_by_round(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """A central evaluation whose accuracy grows by 0.1 a round."""
    return MetricRecord({"accuracy": server_round / 10})


def test_should_stop_ends_the_run_after_the_round_it_says_finished_and_recorded(
    db: str, tmp_path: Path
) -> None:
    asked: list[tuple[int, list[int], float]] = []

    def reached_30_percent(server_round: int, result: Result) -> bool:
        # As Flower 1.43 calls it: the round, and the result so far (that round's model)
        accuracy = result.evaluate_metrics_serverapp[server_round]["accuracy"]
        asked.append((server_round, sorted(result.evaluate_metrics_serverapp), accuracy))
        np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)
        return bool(accuracy >= 0.3)

    result = start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=10,
        ledger=db,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        evaluate_fn=_accuracy_by_round,
        should_stop=reached_30_percent,
        reject_replays=False,
    )
    assert asked == [(1, [0, 1], 0.1), (2, [0, 1, 2], 0.2), (3, [0, 1, 2, 3], 0.3)]
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.rounds_completed, run.num_rounds_planned) == ("finished", 3, 10)
        assert run.final_metrics == {"accuracy": 0.3}  # the last round's, not round 10's
        events = [(e.kind, e.detail) for e in repo.list_events(run.id)]
        assert events == [("stopped-early", {"round": 3, "planned": 10})]
        # round 3's model is the run's final one (flplatform export)
        assert [(c.round, c.kept) for c in repo.list_checkpoints(run.id)] == [(3, True)]


def test_should_stop_is_not_asked_after_the_last_round_nor_by_a_run_that_goes_on(
    db: str,
) -> None:
    asked: list[int] = []
    start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=3,
        ledger=db,
        should_stop=lambda server_round, result: asked.append(server_round) or False,
        reject_replays=False,
    )
    assert asked == [1, 2]
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.rounds_completed) == ("finished", 3)
        assert repo.list_events(run.id) == []


def test_a_run_stopped_just_before_its_process_died_stops_again_when_resumed(
    db: str, tmp_path: Path
) -> None:
    class Died(Exception):
        """The process dying right after round 3 was committed, before should_stop."""

    def die_after_round_3(summary: RoundSummary) -> None:
        if summary.server_round == 3:
            raise Died

    options = dict(
        num_rounds=6, ledger=db, checkpoint_dir=str(tmp_path / "checkpoints"), reject_replays=False
    )
    with pytest.raises(Died):
        start(
            LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, on_round=die_after_round_3,
            evaluate_fn=_accuracy_by_round, **options,
        )  # fmt: skip
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.rounds_completed) == ("failed", 3)
    asked: list[int] = []

    def stop_at_3(server_round: int, result: Result) -> bool:
        asked.append(server_round)
        return server_round >= 3

    start(
        LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, resume_run=run.id,
        should_stop=stop_at_3, evaluate_fn=_accuracy_by_round, **options,
    )  # fmt: skip
    assert asked == [3]  # asked about the round it resumed after, and no round trained
    with LedgerRepository.open(db) as repo:
        run = repo.get_run(run.id)
        assert (run.status, run.rounds_completed) == ("finished", 3)
        assert run.final_metrics == {"accuracy": 0.3}  # round 3's, from the restored history
        assert [e.kind for e in repo.list_events(run.id)] == ["resumed", "stopped-early"]


def test_should_stop_is_checked_and_its_failure_fails_the_run(db: str) -> None:
    with pytest.raises(ConfigError, match="should_stop must be a function"):
        start(LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, should_stop=0.9)  # type: ignore[arg-type]

    def broken(server_round: int, result: Result) -> bool:
        raise KeyError("accuracy")  # no central evaluation: no such metric

    with pytest.raises(KeyError):
        start(
            LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, num_rounds=4, ledger=db,
            should_stop=broken, reject_replays=False,
        )  # fmt: skip
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.rounds_completed) == ("failed", 1)
        assert run.error == "KeyError: 'accuracy'"


def test_should_stop_through_flowers_own_start_signature() -> None:
    # A ServerApp written for Flower 1.43: strategy.start(..., should_stop=...)
    result = LocalSGDAveraging().start(
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=5,
        evaluate_fn=_accuracy_by_round,
        should_stop=lambda server_round, result: server_round == 2,
    )
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]


@pytest.mark.parametrize("sync", ["k-sync", "k-async"])
def test_a_k_no_step_could_reach_is_refused_before_the_first_round(db: str, sync: str) -> None:
    # The ServerApp's own code asks for K = 3 of the 2 sites that joined: the CLI never saw it.
    with pytest.raises(ConfigError) as raised:
        start(
            LocalSGDAveraging(),
            ScriptedGrid(two_sites()),
            MODEL,
            sync=sync,
            k=3,
            ledger=db,
            required_sites=2,  # the federation's size is known: refused at once
        )
    assert "k 3 is more than the 2 sites" in str(raised.value)
    assert "k-batch-async" in str(raised.value)  # what would count any K updates
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "failed" and "k 3 is more than" in (run.error or "")
        assert repo.list_rounds(run.id) == []  # refused before anything trained
    # Without a number of sites to expect, more may still be starting: it waits for them
    # (up to the start-up timeout) before it refuses.
    engine = RoundEngine(
        ScriptedGrid(two_sites()),
        LocalSGDAveraging(),
        policy=Synchrony(sync, k=3),
        required_sites=0,
        startup_timeout=0.5,
    )
    began = time.monotonic()
    with pytest.raises(ConfigError, match="k 3 is more than the 2 sites"):
        engine.run(MODEL, num_rounds=1)
    assert time.monotonic() - began >= 0.5
    # The batch modes count any K updates, which a site may repeat: K = 3 runs.
    start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        sync="k-batch-async",
        k=3,
        num_rounds=1,
        ledger=db,
    )


def test_a_run_that_fails_before_it_starts_is_recorded(db: str) -> None:
    record_failed_start(
        DataError("no test set in data/"), strategy="local-sgd", ledger=db, name="n", tag="x"
    )
    with LedgerRepository.open(db) as repo:
        run = repo.find_run_by_tag("x")
        assert run is not None
        assert (run.status, run.error, run.name) == ("failed", "no test set in data/", "n")


# ============================================================== CLI overrides
def test_options_from_the_environment_override_the_code(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        OPTIONS_ENV,
        options_environment(name="from-cli", num_rounds=1, sync="k-async", k=1)[OPTIONS_ENV],
    )
    start(
        LocalSGDAveraging(),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=3,
        name="from-code",
        ledger=db,
        run_config={"strategy": "local-sgd", "num-server-rounds": 3, "sync": "sync"},
        # the norm check off: it would hold round 1 for both updates (no reference before)
        update_norm_ratio=0.0,
    )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.name, run.num_rounds_planned) == ("from-cli", 1)
        # The recorded config says what ran: the overrides are written into it.
        assert run.config == {
            "strategy": "local-sgd",
            "num-server-rounds": 1,
            "sync": "k-async",
            "k": 1,
        }
        (only,) = repo.list_rounds(run.id)
        assert only.num_applied == 1  # k-async with K = 1: one update makes the step


def test_how_flplatform_run_launched_a_run_is_recorded_with_it(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = {"app": "/apps/mine", "options": {"rounds": 1, "sites": ["a", "b"]}}
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"launched_by": launch, "num_rounds": 1}))
    start(LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, num_rounds=3, ledger=db)
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.config[LAUNCH_KEY] == launch  # what `flplatform resume` reads back
        assert "launched-by" not in run.config  # not an option of the run itself


def test_a_network_from_the_environment_runs_on_its_virtual_clock(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"network": "datacenter"}))
    start(LocalSGDAveraging(), ScriptedGrid(two_sites()), MODEL, num_rounds=1, ledger=db)
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.network == "datacenter" and run.config["network"] == "datacenter"
        assert run.simulated_seconds is not None and run.simulated_seconds > 0
        (only,) = repo.list_rounds(run.id)
        assert only.virtual_finished_at == pytest.approx(run.simulated_seconds)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"speed": 2}', "unknown option 'speed'; allowed: num_rounds"),
        ('{"k": "two"}', "option 'k' must be an integer >= 1, got 'two'"),
        ('{"num_rounds": 0}', "option 'num_rounds' must be an integer >= 1, got 0"),
        ('{"sync": "eventually"}', "option 'sync' must be one of sync, k-sync"),
        ('{"network": 3}', "option 'network' must be a preset name"),
        ('{"launched_by": 3}', "option 'launched_by' must be an object with text keys"),
        ("sync=k-async", "must be a JSON object of start() options; it is not JSON"),
        ('["sync"]', "must be a JSON object of start() options, got list"),
    ],
)
def test_a_bad_environment_is_a_config_error_before_anything_is_recorded(
    db: str, monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv(OPTIONS_ENV, value)
    grid = ScriptedGrid(two_sites())
    with pytest.raises(ConfigError, match=r"FLPLATFORM_OPTIONS") as raised:
        start(LocalSGDAveraging(), grid, MODEL, num_rounds=1, ledger=db)
    assert message in raised.value.reason
    assert grid.pushed == []
    with LedgerRepository.open(db) as repo:
        assert repo.list_runs() == []


def test_each_default_is_the_options_one_in_start_the_ledger_and_the_run_options() -> None:
    import inspect
    from dataclasses import fields

    from flplatform.app.config import RunConfig
    from flplatform.engine.guard import GuardOptions
    from flplatform.run.ledger import SqlLedger
    from flplatform.run.options import DEFAULT_OPTIONS

    given = inspect.signature(start).parameters
    for option in fields(DEFAULT_OPTIONS):
        if option.name in given:
            assert given[option.name].default == getattr(DEFAULT_OPTIONS, option.name), option
    ledger = inspect.signature(SqlLedger.__init__).parameters
    assert ledger["checkpoint_every"].default == DEFAULT_OPTIONS.checkpoint_every == 5
    assert ledger["keep_checkpoints"].default == DEFAULT_OPTIONS.keep_checkpoints == 3
    guard = GuardOptions()
    assert (guard.norm_ratio, guard.min_cosine) == (
        DEFAULT_OPTIONS.update_norm_ratio,
        DEFAULT_OPTIONS.update_min_cosine,
    )
    table = {f.name: f.default for f in fields(RunConfig)}
    for name in ("sync", "seed", "max_failed_rounds", "checkpoint_every", "keep_checkpoints"):
        assert table[name] == getattr(DEFAULT_OPTIONS, name), name
    # k 0 is "not set": start()'s K for the K modes; the sketched strategies require one
    assert table["k"] == 0 and RunConfig().sync_k == DEFAULT_OPTIONS.k == 2
    assert table["update_norm_action"] == DEFAULT_OPTIONS.update_norm_action == "clip"


def test_options_environment_round_trips_and_refuses_what_start_would() -> None:
    environment = options_environment(sync="buffered", k=4, network="world", ledger=None)
    assert options_from_environment(environment) == {
        "sync": "buffered",
        "k": 4,
        "network": "world",
        "ledger": None,
    }
    with pytest.raises(ConfigError, match="unknown option 'rounds'"):
        options_environment(rounds=3)
    with pytest.raises(ConfigError, match="option 'timeout' must be a number of seconds > 0"):
        options_environment(timeout=-1)
    # Every start() keyword that is plain data may come from the command line.
    assert set(OPTION_NAMES) == {f for f in PlatformOptions.__dataclass_fields__}


def test_bad_keyword_arguments_are_config_errors() -> None:
    grid = ScriptedGrid(two_sites())
    with pytest.raises(ConfigError, match=r"start\(\): option 'k' must be an integer >= 1"):
        start(LocalSGDAveraging(), grid, MODEL, sync="k-sync", k=0)
    with pytest.raises(ConfigError, match="also give network"):
        start(LocalSGDAveraging(), grid, MODEL, step_seconds=0.5)
    with pytest.raises(ConfigError, match="runs a Flower strategy"):
        start(object(), grid, MODEL)  # type: ignore[arg-type]


# ============================================================ Flower's strategies
def test_flowers_fedavg_under_the_engine_matches_flowers_own_start(db: str) -> None:
    # (The scripted sites send the same model every round: not a replay attack here.)
    result = start(
        FedAvg(), ScriptedGrid(two_sites()), MODEL, num_rounds=2, ledger=db, reject_replays=False
    )
    flower = FedAvg().start(FlowerGrid(two_sites()), MODEL, num_rounds=2)
    np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)
    np.testing.assert_array_equal(model_of(result.arrays), model_of(flower.arrays))
    assert result.train_metrics_clientapp[2][keys.TRAIN_LOSS] == pytest.approx(0.25)
    assert result.evaluate_metrics_clientapp[2][keys.EVAL_ACCURACY] == pytest.approx(0.5)
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.strategy) == ("finished", "flwr-fedavg")
        rounds = repo.list_rounds(run.id)
        assert [(r.model_version, r.num_applied) for r in rounds] == [(1, 2), (2, 2)]
        # Flower's own metric names, as its aggregate_evaluate returns them.
        assert rounds[1].metrics["site_" + keys.EVAL_ACCURACY] == pytest.approx(0.5)
        evaluations = repo.list_evaluations(run.id)
        assert [e.accuracy for e in evaluations] == [0.5] * 4  # both sites, both rounds


# (the template's and examples' pyproject.toml declare codec = "none" for their own use)
@pytest.mark.parametrize("run_config", [None, {"lr": 0.1}, {"codec": "none"}])
def test_a_strategys_codec_is_recorded_for_history_compare(
    db: str, run_config: dict | None
) -> None:
    # A ServerApp that builds its strategy in code: the codec is in no run config key.
    start(
        LocalSGDAveraging(codec="int8"),
        ScriptedGrid(two_sites()),
        MODEL,
        num_rounds=1,
        ledger=db,
        run_config=run_config,
    )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
    assert run.config["codec"] == "int8"
    assert run_setup(run).codec == "int8"  # what `history compare` shows


def two_metric_records(msg: Message, sent: np.ndarray) -> RecordDict:
    content = trained(9.0, examples=10, loss=0.0)(msg, sent)
    content["more-metrics"] = MetricRecord({"x": 1.0})
    return content


def no_num_examples(msg: Message, sent: np.ndarray) -> RecordDict:
    arrays = ArrayRecord({"w": Array(np.full_like(sent, 9.0))})
    return RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord({keys.TRAIN_LOSS: 0.0})})


def wrong_shape(msg: Message, sent: np.ndarray) -> RecordDict:
    arrays = ArrayRecord({"w": Array(np.full(7, 9.0, np.float32))})
    metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: 0.0})
    return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})


@pytest.mark.parametrize(
    ("odd", "reason"),
    [
        (two_metric_records, "exactly one ArrayRecord and one MetricRecord, got 1 and 2"),
        (no_num_examples, "would refuse it: Missing required key `num-examples`"),
        (wrong_shape, "array 'w' has shape (7,), expected (4,)"),
    ],
)
def test_a_reply_flower_would_refuse_is_rejected_and_the_round_goes_on(
    db: str, odd: Reply, reason: str
) -> None:
    grid = ScriptedGrid({**two_sites(), 3: replying_site("odd", odd)})
    result = start(FedAvg(), grid, MODEL, num_rounds=1, ledger=db)
    np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)  # without the odd one
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished"
        (rejected,) = repo.list_updates(run.id, site="odd")
        assert rejected.status == REJECTED
        assert reason in (rejected.reason or "")


def test_fedavg_itself_refuses_the_round_the_adapter_saves() -> None:
    # What the adapter prevents: Flower's aggregate_train refuses all the replies at once.
    sent = Message(RecordDict({keys.ARRAYS: MODEL}), dst_node_id=1, message_type="train")
    zeros = np.zeros(4, np.float32)
    replies = [
        Message(content, reply_to=sent)
        for content in (trained(1.0, 10, 0.0)(sent, zeros), two_metric_records(sent, zeros))
    ]
    with pytest.raises(InconsistentMessageReplies):
        FedAvg().aggregate_train(1, replies)
    adapter = FlowerStrategyAdapter(FedAvg())
    adapter.begin_aggregation(1, MODEL)
    adapter.accumulate(replies[0], base=MODEL)
    with pytest.raises(UpdateRejected, match="one MetricRecord, got 1 and 2"):
        adapter.accumulate(replies[1], base=MODEL)
    arrays, _ = adapter.finish_aggregation()
    assert arrays is not None
    np.testing.assert_allclose(model_of(arrays), 1.0)


def test_an_evaluation_reply_flower_would_refuse_is_left_out(db: str) -> None:
    odd = replying_site("odd", trained(4.0, examples=30, loss=0.0), accuracy=0.9, extra=True)
    grid = ScriptedGrid({1: replying_site("a", trained(1.0, examples=10, loss=1.0)), 2: odd})
    result = start(FedAvg(), grid, MODEL, num_rounds=1, ledger=db)
    # Flower's FedAvg alone would refuse the round's evaluation (two MetricRecords) and
    # end the run; here the odd reply is left out and the other one counts.
    assert result.evaluate_metrics_clientapp[1][keys.EVAL_ACCURACY] == pytest.approx(0.5)
    np.testing.assert_allclose(model_of(result.arrays), WEIGHTED_MEAN)
    with LedgerRepository.open(db) as repo:
        assert [r.status for r in repo.list_runs()] == ["finished"]


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (lambda: FedAvg(), "Flower's FedAvg aggregates each round's replies at once"),
        (
            lambda: DelayedCompensated(delay=1, num_rounds=2),
            "strategy 'delayed' runs with sync mode 'sync' only, got 'k-sync'",
        ),
        (lambda: FetchSGD(k=2), "strategy 'fetchsgd' runs with sync mode 'sync' only"),
    ],
)
def test_modes_a_strategy_cannot_run_are_refused(
    db: str, strategy: Callable[[], object], message: str
) -> None:
    grid = ScriptedGrid(two_sites())
    with pytest.raises(ConfigError, match=message):
        start(strategy(), grid, MODEL, sync="k-sync", ledger=db)  # type: ignore[arg-type]
    assert grid.pushed == []
    with LedgerRepository.open(db) as repo:
        assert repo.list_runs() == []


# ============================================================ our strategies
def test_fetchsgd_runs_through_flowers_own_start_signature() -> None:
    from tests.helpers.delayed_sites import context, digits_site

    grid = ScriptedGrid({n: digits_site(n - 1, 2, context(n)) for n in (1, 2)})
    initial = digits_model(num_partitions=2)
    calls: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append(server_round)
        return MetricRecord({"changed": float(not np.array_equal(_flat(arrays), _flat(initial)))})

    result = FetchSGD(k=50, seed=1).start(
        grid,
        initial,
        num_rounds=2,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 2, keys.LR: 0.1}),
        evaluate_fn=evaluate_fn,
    )
    assert calls == [0, 1, 2]  # before the first round and after each, as Flower's start
    assert result.evaluate_metrics_serverapp[2]["changed"] == 1.0
    assert sorted(result.train_metrics_clientapp) == [1, 2]


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([a.ravel() for a in record_to_arrays(arrays).values()])


# ============================================================ the package
def test_the_engine_package_gives_the_protocols_without_the_loop() -> None:
    code = (
        "import sys\n"
        "from flplatform.engine import EngineStrategy, AggregationPolicy, Synchrony\n"
        "loop = ['flplatform.engine.' + m for m in ('engine', 'mailbox', 'guard')]\n"
        "assert not [m for m in loop if m in sys.modules], sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_importing_the_package_stays_light_and_start_is_callable() -> None:
    code = (
        "import sys, flplatform, flplatform.core.keys, flplatform.core.errors\n"
        "assert 'flplatform.engine' not in sys.modules, 'the engine was imported'\n"
        "assert 'flwr.serverapp' not in sys.modules, 'the ServerApp was imported'\n"
        "from flplatform.run.start import start\n"
        "assert flplatform.start is start\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
