"""A run's history in MLflow and TensorBoard (``flplatform history export``).

The runs are tests/helpers/comparison_ledger.py's, worked out by hand. What is written goes
to a real MLflow store (SQLite, no server) and real TensorBoard event files, and is read
back with MLflow's own client and TensorBoard's own reader.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.app.tracking import (
    MLFLOW_SOURCE_TAG,
    TENSORBOARD_SOURCE_FILE,
    LiveExport,
    RunSeries,
    mlflow_name,
    run_series,
    tensorboard_directory,
    to_mlflow,
    to_tensorboard,
)
from flplatform.core.errors import ConfigError
from storage import LedgerRepository
from tests.helpers.cli import invoke, one_error_line
from tests.helpers.comparison_ledger import T0, write_comparison_ledger
from tests.helpers.ledger_records import make_run, record, update


@pytest.fixture
def ledger(sqlite_ledger: str) -> str:
    write_comparison_ledger(sqlite_ledger)
    return sqlite_ledger


@pytest.fixture
def runs(ledger: str) -> list[RunSeries]:
    with LedgerRepository.open(ledger) as repository:
        return [run_series(repository, run_id) for run_id in (1, 2)]


def test_a_runs_series_are_its_rounds_as_worked_out_by_hand(runs: list[RunSeries]) -> None:
    run = runs[0]
    assert run.series("accuracy") == [(1, 0.50), (2, 0.92), (3, 0.91)]
    assert run.series("loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert run.series("train_loss") == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert run.series("bytes_up") == [(1, 300.0), (2, 200.0), (3, 300.0)]
    assert run.series("bytes_down") == [(1, 2000.0), (2, 2000.0), (3, 1000.0)]
    assert run.series("eval_bytes_up") == [(1, 30.0), (2, 0.0), (3, 0.0)]
    assert run.series("applied") == [(1, 2.0), (2, 2.0), (3, 1.0)]
    assert run.series("rejected") == run.series("dropped") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert run.series("simulated_seconds") == [(1, 10.0), (2, 25.5), (3, 40.0)]
    # each round finished at T0 + 10·r + 1, the run was created at T0, each took 1 s
    assert run.series("elapsed_seconds") == [(1, 11.0), (2, 21.0), (3, 31.0)]
    assert run.series("round_seconds") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert run.series("staleness_mean") == [(1, 0.0), (2, 0.5), (3, 2.0)]
    assert run.series("staleness_max") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert run.series("site/london/bytes_up") == [(1, 100.0), (2, 150.0), (3, 300.0)]
    assert run.series("site/tokyo/bytes_up") == [(1, 200.0), (2, 50.0)]  # not in round 3
    assert run.series("site/london/staleness") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert run.series("site/london/applied") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert run.series("site/london/bytes_down") == [(1, 1000.0), (2, 1000.0), (3, 1000.0)]
    assert {p.wall_time for p in run.points if p.step == 2} == {T0 + 21}
    assert run.params["sync"] == "k-async" and run.params["k"] == "2"
    assert run.params["strategy"] == "local-sgd" and run.params["seed"] == "4"
    assert run.params["network"] == "world" and run.params["rounds-planned"] == "3"
    assert run.name == "stragglers: k-async K=2" and run.status == "finished"
    # the wall-clock run: the sites' accuracy, no simulated time
    assert runs[1].series("site_accuracy") == [(1, 0.60), (2, 0.95)]
    assert runs[1].series("simulated_seconds") == []
    assert runs[1].params["network"] == "none"


def test_tensorboard_files_hold_every_series_as_tensorboards_reader_reads_them(
    runs: list[RunSeries], tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = to_tensorboard(runs, tmp_path / "tb")
    for run in runs:
        assert folders[run.run_id] == tensorboard_directory(tmp_path / "tb", run.run_id, run.name)
        events = EventAccumulator(str(folders[run.run_id]), size_guidance={"scalars": 0})
        events.Reload()
        assert sorted(events.Tags()["scalars"]) == sorted(run.metric_keys())
        for key in run.metric_keys():
            read = [(s.step, s.value, s.wall_time) for s in events.Scalars(key)]
            wanted = [(p.step, p.value, p.wall_time) for p in run.points if p.key == key]
            assert [r[0] for r in read] == [w[0] for w in wanted], key
            # TensorBoard keeps scalars in float32
            assert [r[1] for r in read] == pytest.approx([w[1] for w in wanted], rel=1e-6), key
            assert [r[2] for r in read] == pytest.approx([w[2] for w in wanted]), key
        [options] = events.Tensors("options/text_summary")  # the options as a text table
        table = options.tensor_proto.string_val[0].decode()
        assert all(f"| {k} | {v} |" in table for k, v in run.params.items())
    with pytest.raises(ConfigError, match="already exists; pass --force"):
        to_tensorboard(runs[:1], tmp_path / "tb")
    to_tensorboard(runs[:1], tmp_path / "tb", replace=True)  # replaced, not appended to
    events = EventAccumulator(str(folders[1]), size_guidance={"scalars": 0})
    events.Reload()
    assert [s.step for s in events.Scalars("accuracy")] == [1, 2, 3]


def test_mlflow_holds_every_metric_param_and_artifact_as_mlflows_client_reads_them(
    runs: list[RunSeries], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    working = tmp_path / "working"  # the directory the command runs in
    working.mkdir()
    monkeypatch.chdir(working)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    written = to_mlflow(runs, uri, experiment="stragglers", artifacts={1: model})
    client = MlflowClient(tracking_uri=uri)
    for run in runs:
        stored = client.get_run(written[run.run_id])
        assert stored.info.run_name == run.name and stored.info.status == "FINISHED"
        assert stored.data.params == run.params
        assert stored.data.tags[MLFLOW_SOURCE_TAG] == run.source
        for key in run.metric_keys():
            history = client.get_metric_history(written[run.run_id], key)
            read = sorted((m.step, m.value, m.timestamp) for m in history)
            points = [p for p in run.points if p.key == key]
            wanted = [(p.step, p.value, int(p.wall_time * 1000)) for p in points]
            assert read == wanted, key
    artifacts = [a.path for a in client.list_artifacts(written[1])]
    assert artifacts == ["model.pt"] and client.list_artifacts(written[2]) == []
    downloaded = client.download_artifacts(written[1], "model.pt", str(tmp_path / "back"))
    assert Path(downloaded).read_bytes() == b"weights"
    # the artifacts sit beside the store, never in the directory the command ran in
    assert [p.name for p in (tmp_path / "mlruns").rglob("model.pt")] == ["model.pt"]
    assert list(working.iterdir()) == []

    with pytest.raises(ConfigError, match="run 1, 2 was exported .* pass --force"):
        to_mlflow(runs, uri, experiment="stragglers")
    again = to_mlflow(runs[:1], uri, experiment="stragglers", replace=True)
    experiment = client.get_experiment_by_name("stragglers")
    live = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_id for r in live) == sorted([again[1], written[2]])


def test_history_export_writes_both_and_says_where(ledger: str, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = invoke(
        ["history", "export", "1", "latest", "--db", ledger]
        + ["--mlflow", uri, "--tensorboard", str(tmp_path / "tb")]
    )
    assert result.exit_code == 0, result.output
    assert "Run 1 (stragglers: k-async K=2) → TensorBoard: " in result.output
    assert "in experiment 'flplatform' (no checkpoint: no model)" in result.output
    assert len(list((tmp_path / "tb").iterdir())) == 2  # runs 1 and 4 ('latest')


@pytest.mark.parametrize("written_before", ["mlflow", "tensorboard"])
def test_an_export_refused_by_one_store_writes_nothing_to_the_other(
    ledger: str, tmp_path: Path, written_before: str
) -> None:
    """Exporting again to both stores, one of them holding the run already: refused, and
    the other not written either (TensorBoard was written first, so that the retry then
    needed --force for it)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tb = tmp_path / "tb"
    first = ["--mlflow", uri] if written_before == "mlflow" else ["--tensorboard", str(tb)]
    assert invoke(["history", "export", "1", "--db", ledger, *first]).exit_code == 0
    again = invoke(
        ["history", "export", "1", "--db", ledger, "--mlflow", uri, "--tensorboard", str(tb)]
    )
    assert again.exit_code == 2 and "--force" in one_error_line(again.output)
    if written_before == "mlflow":
        assert not tb.exists()
    else:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("flplatform")
        assert experiment is None or client.search_runs([experiment.experiment_id]) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "say where to export: --mlflow URI, --tensorboard DIR, or both"),
        (["--tensorboard", "FILE"], "--tensorboard must be a folder"),
        (["--mlflow", "nonsense://x"], "cannot use the MLflow store at nonsense://x: "),
    ],
)
def test_history_export_errors_are_one_line(
    ledger: str, tmp_path: Path, args: list[str], says: str
) -> None:
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    result = invoke(["history", "export", "1", "--db", ledger, *args])
    assert result.exit_code != 0
    assert says in one_error_line(result.output)


@pytest.mark.parametrize(
    ("flag", "module", "extra"),
    [("--mlflow", "mlflow", "mlflow"), ("--tensorboard", "torch.utils.tensorboard", "tensorboard")],
)
def test_a_missing_extra_is_named(
    ledger: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flag: str,
    module: str,
    extra: str,
) -> None:
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # its import fails, as if not installed
    monkeypatch.setitem(sys.modules, module, None)
    result = invoke(["history", "export", "1", "--db", ledger, flag, str(tmp_path / "x")])
    assert result.exit_code != 0
    assert f"pip install 'flplatform[{extra}]'" in one_error_line(result.output)


def commit_round(
    repository: LedgerRepository, run_id: int, step: int, *, london_up: int | None = None
) -> None:
    """Round ``step`` of the run, committed: accuracy step/10, and london's applied update
    of ``london_up`` bytes when given."""
    updates = []
    if london_up is not None:
        updates.append(
            update(
                "london",
                dispatched_round=step,
                version_trained_on=step - 1,
                bytes_up=london_up,
                bytes_down=7,
                dispatched_at=T0 + step,
                arrived_at=T0 + step + 0.25,
                train_loss=None,
                compute_seconds=None,
            )
        )
    record(
        repository,
        run_id,
        step,
        updates,
        started_at=T0 + step,
        finished_at=T0 + step + 0.5,
        metrics={"accuracy": step / 10},
        train_loss=None,
    )


def test_a_run_is_logged_round_by_round_as_the_ledger_commits_it(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    live = LiveExport(sqlite_ledger, mlflow=uri, tensorboard=tmp_path / "tb")
    live.check()
    client = MlflowClient(tracking_uri=uri)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="live", strategy="local-sgd", seed=3, config={"k": 2}, num_rounds_planned=3
        )
        repository.add_site(run_id, name="london", node_id=1)
        live.update(repository.get_run(run_id), [])  # the run is there, no round yet
        [mlflow_run] = client.search_runs(
            [client.get_experiment_by_name("flplatform").experiment_id]
        )
        assert mlflow_run.info.status == "RUNNING" and mlflow_run.data.params["k"] == "2"
        for step in (1, 2, 3):
            commit_round(repository, run_id, step, london_up=100 * step)
            live.update(repository.get_run(run_id), repository.list_rounds(run_id))
            # what a user watching MLflow or TensorBoard sees now: every round so far, once
            history = client.get_metric_history(mlflow_run.info.run_id, "site/london/bytes_up")
            assert sorted((m.step, m.value) for m in history) == [
                (s, 100.0 * s) for s in range(1, step + 1)
            ]
            events = EventAccumulator(str(tmp_path / "tb" / f"{run_id}-live"))
            events.Reload()
            scalars = events.Scalars("accuracy")
            assert [s.step for s in scalars] == list(range(1, step + 1))
            assert [s.value for s in scalars] == pytest.approx([s / 10 for s in range(1, step + 1)])
        repository.finish_run(run_id, status="finished")
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    live.close(model)
    assert live.stopped is None
    finished = client.get_run(mlflow_run.info.run_id)
    assert finished.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id)] == ["model.pt"]

    # Logged live, the run holds every metric, series and parameter that an export of the
    # finished run writes (each of which the export tests check), with the same values.
    exported_uri = f"sqlite:///{tmp_path / 'exported.db'}"
    exported_tb = tmp_path / "exported-tb"
    done = invoke(
        ["history", "export", str(run_id), "--db", sqlite_ledger, "--mlflow", exported_uri,
         "--tensorboard", str(exported_tb)]
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    other = MlflowClient(tracking_uri=exported_uri)
    [exported] = other.search_runs([other.get_experiment_by_name("flplatform").experiment_id])
    assert len(exported.data.metrics) > 10  # rounds' and the site's series
    assert set(finished.data.metrics) == set(exported.data.metrics)
    for key in exported.data.metrics:
        live_points = client.get_metric_history(finished.info.run_id, key)
        exported_points = other.get_metric_history(exported.info.run_id, key)
        assert sorted((m.step, m.value) for m in live_points) == sorted(
            (m.step, m.value) for m in exported_points
        ), key
    assert finished.data.params == exported.data.params
    live_events = EventAccumulator(str(tmp_path / "tb" / f"{run_id}-live"))
    exported_events = EventAccumulator(str(exported_tb / f"{run_id}-live"))
    live_events.Reload()
    exported_events.Reload()
    tags = exported_events.Tags()["scalars"]
    assert sorted(live_events.Tags()["scalars"]) == sorted(tags) and len(tags) > 10
    for tag in tags:
        assert [(e.step, e.value) for e in live_events.Scalars(tag)] == [
            (e.step, e.value) for e in exported_events.Scalars(tag)
        ], tag


def test_an_export_that_fails_stops_saying_why_ends_its_run_failed_and_the_run_goes_on(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from flplatform.app.tracking import MlflowRun

    writes = 0
    write = MlflowRun.write

    def store_gone(self: MlflowRun, points: object) -> None:
        nonlocal writes
        writes += 1
        with self.store.errors():  # as MLflow's client fails: through the store's errors
            raise MlflowException("the tracking server went away")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    live = LiveExport(ledger, mlflow=uri)
    with LedgerRepository.open(ledger) as repository:
        record, rounds = repository.get_run(1), repository.list_rounds(1)
    live.update(record, rounds[:1])
    monkeypatch.setattr(MlflowRun, "write", store_gone)
    live.update(record, rounds[:2])  # no exception reaches the run
    assert live.stopped == f"MLflow at {uri}: the tracking server went away"
    live.update(record, rounds)  # stopped: nothing more is tried
    assert writes == 1
    monkeypatch.setattr(MlflowRun, "write", write)
    live.close()
    assert writes == 1
    client = MlflowClient(tracking_uri=uri)
    [logged] = client.search_runs([client.get_experiment_by_name("flplatform").experiment_id])
    # ended, not left RUNNING; with the round written before the store failed
    assert logged.info.status == "FAILED" and logged.data.tags["flplatform.status"] == "failed"
    assert [m.step for m in client.get_metric_history(logged.info.run_id, "accuracy")] == [1]


LONG_SITE_KEY = f"site/{'s' * 300}/bytes_up"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("accuracy", "accuracy"),
        ("acc@1", "acc_1"),
        ("site/tokyo/bytes_up", "site/tokyo/bytes_up"),
        ("a//b", "a/b"),
        ("/x/./y/../z/", "x/y/z"),
        ("top-1 (%)", "top-1 ___"),
        ("", "_"),
        ("é:ü", "é_ü"),  # MLflow's \w is Unicode's
        ("site/東京/bytes_up", "site/東京/bytes_up"),
        ("m" * 300, "m" * 241 + "-" + digest("m" * 300)),
        (LONG_SITE_KEY, f"site/{'s' * 227}-{digest(LONG_SITE_KEY)}/bytes_up"),
    ],
)
def test_metric_names_are_made_what_mlflow_accepts(key: str, name: str) -> None:
    assert mlflow_name(key) == name


@settings(deadline=None)  # the first example imports MLflow: seconds, where none ran before
@given(st.text(max_size=300))
def test_every_name_made_for_mlflow_passes_mlflows_own_checks(key: str) -> None:
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    name = mlflow_name(key)
    _validate_metric_name(name)
    _validate_param_name(name)
    assert mlflow_name(name) == name  # a name MLflow accepts is kept as it is


def test_an_apps_odd_metric_names_reach_mlflow_and_never_hide_the_platforms(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="odd", strategy="own", seed=0, config={"top@k": 5}, num_rounds_planned=1
        )
        repository.record_round(
            run_id,
            round=1,
            model_version=1,
            started_at=T0,
            finished_at=T0 + 1,
            metrics={"acc@1": 0.5, "bytes_up": 7.0},
            train_loss=None,
            updates=[],
        )
        series = run_series(repository, run_id)
    assert series.series("bytes_up") == [(1, 0.0)]  # the ledger's; the app's beside it
    assert series.series("metrics/bytes_up") == [(1, 7.0)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    written = to_mlflow([series], uri)
    stored = MlflowClient(tracking_uri=uri).get_run(written[run_id])
    assert stored.data.metrics["acc_1"] == 0.5 and stored.data.metrics["metrics/bytes_up"] == 7.0
    assert stored.data.params["top_k"] == "5"


def test_mlflow_runs_start_and_end_when_the_runs_did(runs: list[RunSeries], tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    written = to_mlflow(runs[:1], uri)
    stored = MlflowClient(tracking_uri=uri).get_run(written[1])
    # run 1 of the comparison ledger: created at T0, finished at T0 + 50
    assert stored.info.start_time == int(T0 * 1000)
    assert stored.info.end_time == int((T0 + 50) * 1000)


def test_a_deleted_experiment_is_named_not_written_to(
    runs: list[RunSeries], tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(ConfigError, match="experiment 'gone' .* was deleted: restore it"):
        to_mlflow(runs, uri, experiment="gone")


def test_force_never_replaces_another_ledgers_run_in_tensorboard(
    runs: list[RunSeries], tmp_path: Path, new_sqlite_ledger: Callable[[str], str]
) -> None:
    other = new_sqlite_ledger("other.db")  # the same runs, ids and names: another ledger
    write_comparison_ledger(other)
    with LedgerRepository.open(other) as repository:
        theirs = run_series(repository, 1)
    assert theirs.source != runs[0].source and theirs.name == runs[0].name
    folders = to_tensorboard([theirs], tmp_path / "tb")
    with pytest.raises(ConfigError, match="holds another run"):
        to_tensorboard(runs[:1], tmp_path / "tb", replace=True)
    assert (folders[1] / TENSORBOARD_SOURCE_FILE).read_text().strip() == theirs.source
    to_tensorboard([theirs], tmp_path / "tb", replace=True)  # its own run: replaced


def test_a_run_ended_by_ctrl_c_is_caught_up_and_ended_in_mlflow(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from flplatform.cli.tracking import exporting, live_export

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shown: list[int] = []
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="stopped", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        commit_round(repository, run_id, 1)
        with pytest.raises(KeyboardInterrupt), live_export(sqlite_ledger, uri, None, "x") as live:
            assert live is not None
            follow = exporting(lambda record, done, failed: shown.append(len(done)), live)
            follow(repository.get_run(run_id), repository.list_rounds(run_id), [])
            commit_round(repository, run_id, 2)  # committed after the last poll
            repository.finish_run(run_id, status="failed", error="stopped by SIGINT")
            raise KeyboardInterrupt
    assert shown == [1]
    client = MlflowClient(tracking_uri=uri)
    [logged] = client.search_runs([client.get_experiment_by_name("x").experiment_id])
    assert logged.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(logged.info.run_id, "accuracy")] == [1, 2]


def test_site_series_stay_apart_whatever_the_sites_names(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    """Non-ASCII names all became "_" (東京 and 大阪 were one series, two values a step),
    and long ones were cut to one name for bytes_up and bytes_down."""
    from mlflow.tracking import MlflowClient

    long_a, long_b = "a" * 240 + "-lab-one", "a" * 240 + "-lab-two"
    sites = ["東京", "大阪", long_a, long_b]
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = make_run(repository)
        for node, site in enumerate(sites, start=1):
            repository.add_site(run_id, name=site, node_id=node)
        for step in (1, 2):
            record(
                repository,
                run_id,
                step,
                [update(s, bytes_up=100 * (i + 1)) for i, s in enumerate(sites)],
            )
        series = run_series(repository, run_id)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    written = to_mlflow([series], uri)
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_run(written[run_id]).data.metrics
    up = sorted(value for key, value in metrics.items() if key.endswith("/bytes_up"))
    assert up == [100.0, 200.0, 300.0, 400.0]  # four series, each its own site's
    for key in metrics:
        history = client.get_metric_history(written[run_id], key)
        assert sorted(m.step for m in history) == [1, 2], key  # one value a step
    assert "site/東京/bytes_up" in metrics


def test_names_that_mlflow_makes_the_same_are_kept_apart(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    """Options "top@k" and "top#k" were both the parameter top_k: MLflow refused the batch
    and the export was impossible; an app's "/bytes_up" and "round@seconds" were written
    into the platform's bytes_up and round_seconds."""
    from mlflow.tracking import MlflowClient

    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = make_run(repository, config={"top@k": 1, "top#k": 2})
        repository.add_site(run_id, name="lab", node_id=1)
        record(
            repository,
            run_id,
            1,
            [update("lab")],
            metrics={"/bytes_up": 7.0, "round@seconds": 99.0},
        )
        series = run_series(repository, run_id)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stored = MlflowClient(tracking_uri=uri).get_run(to_mlflow([series], uri)[run_id]).data
    assert sorted(v for k, v in stored.params.items() if k.startswith("top_k")) == ["1", "2"]
    assert stored.metrics["bytes_up"] == 100.0 and stored.metrics["round_seconds"] == 3.5
    assert stored.metrics["metrics/bytes_up"] == 7.0
    assert stored.metrics["metrics/round_seconds"] == 99.0


def test_an_export_whose_parameters_fail_leaves_no_run_behind(
    sqlite_ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run was made before its parameters were logged: when that failed it stayed,
    RUNNING and tagged as exported, and every later export was refused as a repeat."""
    from mlflow.tracking import MlflowClient

    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = make_run(repository)
        repository.add_site(run_id, name="lab", node_id=1)
        record(repository, run_id, 1, [update("lab")])
        series = run_series(repository, run_id)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    original = MlflowClient.log_batch

    def failing(self: MlflowClient, run_id: str, *args: object, **kwargs: object) -> None:
        if kwargs.get("params"):
            from mlflow.exceptions import MlflowException

            raise MlflowException("the store refused the parameters")
        original(self, run_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    with pytest.raises(ConfigError, match="refused the parameters"):
        to_mlflow([series], uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("flplatform")
    assert experiment is not None and client.search_runs([experiment.experiment_id]) == []
    monkeypatch.setattr(MlflowClient, "log_batch", original)
    assert run_id in to_mlflow([series], uri)  # not refused as exported before


def test_a_run_still_training_is_not_exported_as_failed(sqlite_ledger: str, tmp_path: Path) -> None:
    """Exported while it trained (`latest`), it was written to MLflow as FAILED, ended now."""
    from flplatform.run.ledger import process_owner

    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = make_run(repository, owner=process_owner())  # this process: alive
        repository.add_site(run_id, name="lab", node_id=1)
        record(repository, run_id, 1, [update("lab")])
    result = invoke(
        ["history", "export", "latest", "--db", sqlite_ledger]
        + ["--mlflow", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    )
    assert result.exit_code == 2
    assert f"run {run_id} is still training" in one_error_line(result.output)
    assert not (tmp_path / "mlflow.db").exists()


def test_a_long_run_name_has_a_tensorboard_folder(tmp_path: Path) -> None:
    for name in ("n" * 255, "東" * 90):  # names the ledger takes (up to 255 characters)
        folder = tensorboard_directory(tmp_path, 7, name)
        folder.mkdir()  # within the 255 bytes a file name may have
        assert len(folder.name.encode()) <= 255
    assert tensorboard_directory(tmp_path, 7, "n" * 255) != tensorboard_directory(
        tmp_path, 7, "n" * 254 + "m"
    )


def test_a_resumed_run_logged_live_is_one_export_of_every_round(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    """The command following a run was killed after round 2 and the run resumed with the
    same --mlflow and --tensorboard: the resume's export was a second MLflow run (the
    first left RUNNING with rounds 1-2), and its TensorBoard folder, the same run's own,
    was refused as another's, stopping the export."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="live", strategy="local-sgd", seed=3, config={}, num_rounds_planned=4
        )
        repository.add_site(run_id, name="london", node_id=1)
        first = LiveExport(sqlite_ledger, mlflow=uri, tensorboard=tmp_path / "tb")
        for step in (1, 2):
            commit_round(repository, run_id, step, london_up=100 * step)
            first.update(repository.get_run(run_id), repository.list_rounds(run_id))
        # killed: `first` is never closed; the resume follows the run with a new export
        resumed = LiveExport(sqlite_ledger, mlflow=uri, tensorboard=tmp_path / "tb")
        for step in (3, 4):
            commit_round(repository, run_id, step, london_up=100 * step)
            resumed.update(repository.get_run(run_id), repository.list_rounds(run_id))
        repository.finish_run(run_id, status="finished")
    resumed.close()
    assert resumed.stopped is None
    experiment = client.get_experiment_by_name("flplatform")
    assert experiment is not None
    [logged] = client.search_runs([experiment.experiment_id])
    assert logged.info.status == "FINISHED"
    history = client.get_metric_history(logged.info.run_id, "site/london/bytes_up")
    assert sorted((m.step, m.value) for m in history) == [(s, 100.0 * s) for s in (1, 2, 3, 4)]
    events = EventAccumulator(str(tmp_path / "tb" / f"{run_id}-live"))
    events.Reload()
    assert [s.step for s in events.Scalars("accuracy")] == [1, 2, 3, 4]


def test_a_ledger_reached_through_a_link_is_exported_once(ledger: str, tmp_path: Path) -> None:
    """The ledger's id was its path as given: read through a link (to the file, or a linked
    directory) it was another ledger, its runs exported to MLflow a second time and its
    TensorBoard folders refused, even with --force, as another ledger's."""
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "ledger.db")  # the `ledger` fixture's file
    through_link = f"sqlite:///{link}"
    with LedgerRepository.open(ledger) as real, LedgerRepository.open(through_link) as linked:
        assert run_series(linked, 1).source == run_series(real, 1).source
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tb = str(tmp_path / "tb")
    first = invoke(["history", "export", "1", "--db", ledger, "--mlflow", uri, "--tensorboard", tb])
    assert first.exit_code == 0, first.output
    again = invoke(["history", "export", "1", "--db", through_link, "--mlflow", uri])
    assert again.exit_code == 2
    assert "run 1 was exported to experiment 'flplatform'" in one_error_line(again.output)
    # --force replaces the folder: its own run, not another ledger's
    forced = invoke(
        ["history", "export", "1", "--db", through_link, "--tensorboard", tb, "--force"]
    )
    assert forced.exit_code == 0, forced.output


def test_where_a_run_kept_its_files_is_no_parameter(sqlite_ledger: str, tmp_path: Path) -> None:
    """The ledger's URL (a host: only its password was masked), the checkpoint folder and
    the app's and working directory were MLflow parameters and TensorBoard's options."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flplatform.run.run_record import LAUNCH_KEY

    config = {
        "lr": 0.1,
        "db": "postgresql+psycopg://fl@ledger.internal.example:5432/runs",
        "checkpoint-dir": "/srv/fl/checkpoints",
        LAUNCH_KEY: {"app": "/home/alice/app", "cwd": "/home/alice", "options": {"k": 2}},
    }
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = make_run(repository, config=config)
        repository.add_site(run_id, name="lab", node_id=1)
        record(repository, run_id, 1, [update("lab")])
        series = run_series(repository, run_id)
    assert series.params["lr"] == "0.1"
    assert not {"db", "checkpoint-dir", LAUNCH_KEY} & set(series.params)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stored = MlflowClient(tracking_uri=uri).get_run(to_mlflow([series], uri)[run_id]).data
    folder = to_tensorboard([series], tmp_path / "tb")[run_id]
    events = EventAccumulator(str(folder))
    events.Reload()
    [options] = events.Tensors("options/text_summary")
    table = options.tensor_proto.string_val[0].decode()
    for written in (json.dumps(stored.params), table):
        assert "lr" in written
        assert [h for h in ("ledger.internal", "/srv/fl", "alice") if h in written] == []
