"""Real Flower simulations on a simulated network, through the CLI, checked in the ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.app.demo import build_panels, sweep_members
from flplatform.cli.app import app
from flplatform.cli.demo import demo_experiment
from flplatform.cli.render import human_bytes
from storage import LedgerRepository

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("flplatform_home")]
runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def test_k_async_on_the_world_network(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    mlflow = f"sqlite:///{tmp_path / 'mlflow.db'}"  # logged as it trains (--mlflow)
    args = ["simulate", "--network", "world", "--sync", "k-async", "--k", "2"]
    args += ["--rounds", "8", "--local-epochs", "1", "--db", db, "--mlflow", mlflow]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "simulated" in result.output
    assert f"was logged to MLflow ({mlflow}) as it trained" in result.output

    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.network == "world" and run.config["sync"] == "k-async"
        rounds = repo.list_rounds(run.id)
        assert run.simulated_seconds == pytest.approx(rounds[-1].virtual_finished_at)
        finished = [r.virtual_finished_at for r in rounds]
        assert finished == sorted(finished) and finished[0] > 0
        # Each site has its map profile (Tokyo: 277 ms, 13 Mbit/s) and a seeded speed.
        profiles = {s.name: s.profile for s in repo.list_sites(run.id)}
        assert profiles["tokyo"]["rtt_ms"] == pytest.approx(277)
        assert profiles["tokyo"]["uplink_mbps"] == pytest.approx(13)
        assert 0.5 <= profiles["london"]["speed"] <= 2.0

        updates = repo.list_updates(run.id)
        applied = [u for u in updates if u.status == "applied"]
        # K = 2 a step; the first takes three sites' updates, judged together (the guard's
        # first norm reference: the site that answers first cannot set it alone)
        assert [r.num_applied for r in rounds] == [3] + [2] * 7
        # K-async keeps stragglers: some updates arrive computed on older versions, and
        # each says which version it was computed on.
        assert any(u.staleness > 0 for u in applied)
        for u in applied:
            assert u.version_trained_on == u.round - 1 - u.staleness
            rtt, bandwidth = profiles[u.site]["rtt_ms"] / 1e3, profiles[u.site]["uplink_mbps"]
            transfer = rtt + 8 * (u.bytes_up + u.bytes_down) / (bandwidth * 1e6)
            assert u.transfer_seconds == pytest.approx(transfer, rel=1e-9)
            assert u.virtual_arrived_at == pytest.approx(
                u.virtual_dispatched_at + u.transfer_seconds + u.virtual_compute_seconds
            )

    # MLflow holds each round of the ledger, on the simulated clock too, and the final model
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow)
    [logged] = client.search_runs([client.get_experiment_by_name("flplatform").experiment_id])
    assert logged.info.status == "FINISHED" and logged.data.params["sync"] == "k-async"
    for key, wanted in [
        ("accuracy", [r.metrics["accuracy"] for r in rounds]),
        ("simulated_seconds", finished),
        ("applied", [float(r.num_applied) for r in rounds]),
    ]:
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(logged.info.run_id, key)
        )
        assert history == list(enumerate(wanted, start=1)), key
    assert [a.path for a in client.list_artifacts(logged.info.run_id)] == ["model.pt"]

    shown = runner.invoke(app, ["history", "sites", str(run.id), "--db", db, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    sites = json.loads(shown.output)
    assert {s["name"] for s in sites} == {"london", "ohio", "california", "tokyo"}
    assert all(s["waiting_clock"] == "virtual" and s["waiting_seconds"] >= 0 for s in sites)
    assert sum(count for s in sites for _, count in s["staleness_counts"]) == len(applied)


def test_the_cross_silo_demo_runs_its_panels_in_one_sweep_and_plots_each(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    mlflow = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "plots"
    result = runner.invoke(
        app,
        ["demo", "cross-silo", "--max-rounds", "2", "--seed", "1", "--db", db, "--out", str(out)]
        + ["--mlflow", mlflow],
        terminal_width=100,
    )
    assert result.exit_code == 0, result.output
    panels = build_panels(seed=1, max_rounds=2)
    client = MlflowClient(tracking_uri=mlflow)
    for panel in panels:
        assert f"{panel.key}: " in result.output  # its section of the table and its verdict
        assert (out / f"{panel.key}.png").read_bytes().startswith(PNG)
        # --mlflow: the panel's runs side by side in an experiment of their own
        experiment = client.get_experiment_by_name(demo_experiment(panel))
        logged = client.search_runs([experiment.experiment_id])
        assert sorted(r.info.run_name for r in logged) == sorted(m.run_name for m in panel.members)
        assert all(len(client.get_metric_history(r.info.run_id, "bytes_up")) == 2 for r in logged)
    # no other experiment of ours (the store's check left no empty "flplatform" behind)
    named = {e.name for e in client.search_experiments()} - {"Default"}
    assert named == {demo_experiment(panel) for panel in panels}
    with LedgerRepository.open(db) as repo:
        runs = repo.list_runs()[::-1]
        # Every member a finished run of its own, under its name, with its own options.
        members = sweep_members(panels)
        assert [r.name for r in runs] == [m.run_name for m in members]
        for run, member in zip(runs, members, strict=True):
            assert run.status == "finished" and run.seed == 1
            assert len(repo.list_rounds(run.id)) == 2
            for key in ("strategy", "sync", "model", "codec", "network", "compute-model"):
                assert run.config[key] == member.to_run_config()[key], (run.name, key)
        by_name = {r.name: r for r in runs}
        k_sync = by_name["stragglers: k-sync K=2"]
        cancelled = [u for u in repo.list_updates(k_sync.id) if u.status == "cancelled"]
        # the stragglers of each of the two steps: one of the first (it takes three
        # updates, the guard's first reference), two of the second
        assert len(cancelled) == 3
        # The summary's "in all" bytes of the compression reference are the ledger's.
        reference = by_name["compression: local-SGD, uncompressed"]
        uploaded = sum(r.bytes_up for r in repo.list_rounds(reference.id))
    assert human_bytes(uploaded) in result.output


def test_a_network_profile_file(tmp_path: Path) -> None:
    profile = tmp_path / "labs.toml"
    profile.write_text(
        """
[defaults]
rtt_ms = 50
uplink_mbps = 10
downlink_mbps = 100
[defaults.compute]
model = "fixed"
mean_seconds = 0.01
[sites.london]
[sites.ohio]
rtt_ms = 400
"""
    )
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = runner.invoke(
        app,
        ["simulate", "--network", str(profile), "--sites", "london,ohio", "--rounds", "2"]
        + ["--local-steps", "5", "--db", db],
    )
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.network == str(profile)
        updates = repo.list_updates(run.id)
        for u in updates:  # 5 steps × 10 ms, fixed
            assert u.virtual_compute_seconds == pytest.approx(0.05)
        ohio = [u for u in updates if u.site == "ohio"]
        assert all(u.transfer_seconds > 0.4 for u in ohio)
