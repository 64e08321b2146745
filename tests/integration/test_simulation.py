"""Real Flower simulations (SuperLink + flwr run + Ray) checked through the SQL ledger."""

from __future__ import annotations

import csv
import io
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clients.datasets import load_dataset
from clients.models import build_model, count_parameters
from flplatform.app.config import RunConfig
from flplatform.cli.app import app
from flplatform.core import keys
from flplatform.launch.flower import ACTORS_ENV, start_simulation, work_home
from flplatform.launch.processes import ListeningSocket, ProcessTree, listening_sockets
from flplatform.launch.simulation import run_simulation
from storage import LedgerRepository

pytestmark = pytest.mark.slow
runner = CliRunner()
STARTUP_SECONDS = 240.0  # Flower and Ray starting on a busy 2-core machine
LINUX_PROC = Path("/proc").is_dir()  # sockets are read from /proc (Linux only)


@pytest.mark.usefixtures("flplatform_home")
def test_three_sites_two_rounds_fill_the_ledger_and_listen_on_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One real simulation, two checks: what the ledger holds, and that every process it
    starts (SuperLink, SuperExec, flwr-simulation, Ray's gcs_server, raylet and agents,
    the ClientApp actors) listens on loopback only, read from ``/proc`` as it runs, the
    way ``ss -ltunp`` finds them."""
    # A Ray instance named in the environment is not joined: the simulation starts its own.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    tag = uuid.uuid4().hex
    config = RunConfig.from_mapping(
        {
            "sites": "london,ohio,california",
            "num-server-rounds": 2,
            "local-epochs": 1,
            "fraction-evaluate": 1.0,
            "db": db,
            "run-tag": tag,
        }
    )
    seen: set[ListeningSocket] = set()
    with ProcessTree() as tree:
        process = start_simulation(config, home=work_home(), log_name=tag[:12], tree=tree)
        deadline = time.monotonic() + STARTUP_SECONDS
        while process.poll() is None:
            assert time.monotonic() < deadline, "the simulation did not end in time"
            tree.record()
            if LINUX_PROC:
                seen.update(listening_sockets(tree.alive()))
            time.sleep(0.1)
        assert process.poll() == 0, process.log_tail()
        superlink = process.superlink.pid
    if LINUX_PROC:
        # The scan saw the processes that listen: the SuperLink, Ray's own and the actors'.
        commands = {s.command for s in seen}
        assert any(s.pid == superlink for s in seen), sorted(map(str, seen))
        assert {"gcs_server", "raylet"} <= commands, sorted(map(str, seen))
        assert any(c.startswith("ray::ClientApp") for c in commands), sorted(map(str, seen))
        assert sorted(str(s) for s in seen if not s.loopback) == []

    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished"
        assert run.strategy == "local-sgd"
        assert run.num_rounds_planned == 2
        assert run.config["sites"] == "london,ohio,california"

        sites = repo.list_sites(run.id)
        assert [s.name for s in sites] == ["london", "ohio", "california"]
        assert [s.partition_id for s in sites] == [0, 1, 2]
        # The three partitions (less each site's 10% validation slice) cover the train set.
        train_size = len(load_dataset("digits", seed=0).y_train)
        assert 0.85 * train_size < sum(s.num_examples or 0 for s in sites) <= train_size

        rounds = repo.list_rounds(run.id)
        assert [r.round for r in rounds] == [1, 2]
        assert [r.model_version for r in rounds] == [1, 2]
        assert rounds[1].metrics["accuracy"] > 0.3  # ten classes: chance is 0.1
        # Federated evaluation: the sites' own validation slices, example-weighted.
        assert 0.3 < rounds[1].metrics[keys.SITE_ACCURACY] <= 1.0
        assert rounds[1].metrics[keys.SITE_LOSS] < rounds[0].metrics[keys.SITE_LOSS]
        assert all(
            r.num_applied == 3 and r.num_dropped == 0 and r.num_rejected == 0 for r in rounds
        )

        updates = repo.list_updates(run.id)
        assert len(updates) == 6
        # The model is an MLP on 8x8 digits: every message carries all its float32 weights.
        payload = 4 * count_parameters(build_model("mlp", input_shape=(1, 8, 8), num_classes=10))
        for update in updates:
            assert update.status == "applied"
            assert update.staleness == 0
            assert update.version_trained_on == update.round - 1
            assert update.num_examples == next(
                s.num_examples for s in sites if s.name == update.site
            )
            # Wire size = payload + Flower's per-object headers and metadata and the
            # protocol envelopes (object trees, the push acknowledgement): a few KB.
            assert payload < update.bytes_down < payload + 8000
            assert payload < update.bytes_up < payload + 8000
            assert update.compute_seconds is not None and update.compute_seconds > 0
            assert update.train_loss is not None and np.isfinite(update.train_loss)
        assert rounds[0].bytes_up == sum(u.bytes_up for u in updates if u.round == 1)
        evaluations = repo.list_evaluations(run.id)
        assert len(evaluations) == 6 and all(e.status == "evaluated" for e in evaluations)
        # An evaluation message carries the whole model down, like a training message.
        assert all(payload < e.bytes_down < payload + 8000 for e in evaluations)
        # Each site's information query is its own traffic, one per site.
        queries = repo.list_traffic(run.id, kind="query")
        assert sorted(q.site for q in queries) == sorted(s.name for s in sites)
        assert all(q.messages == 1 and q.bytes_up > 0 and q.bytes_down > 0 for q in queries)
        # The run's totals are every row's bytes: updates, evaluations and traffic.
        total = repo.get_run(run.id)
        assert total.bytes_up == sum(u.bytes_up for u in updates) + sum(
            e.bytes_up for e in evaluations
        ) + sum(t.bytes_up for t in repo.list_traffic(run.id))

    # The history CLI reads the same rows back.
    shown = runner.invoke(app, ["history", "rounds", str(run.id), "--db", db, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    assert [row["model_version"] for row in json.loads(shown.output)] == [1, 2]
    sites_csv = runner.invoke(app, ["history", "sites", "latest", "--db", db, "--format", "csv"])
    assert sites_csv.exit_code == 0
    rows = list(csv.DictReader(io.StringIO(sites_csv.output)))
    assert [r["name"] for r in rows] == ["london", "ohio", "california"]
    assert all(int(r["applied"]) == 2 and int(r["bytes_up"]) > payload for r in rows)


@pytest.mark.usefixtures("flplatform_home")
def test_malformed_replies_are_rejected_and_the_run_goes_on(
    tmp_path: Path, hostile_app: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slow site sleeps past the round's real timeout in one actor; the others train
    # in the second meanwhile, as on a user's machine.
    monkeypatch.setenv(ACTORS_ENV, "2")
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    config = RunConfig.from_mapping(
        {
            "sites": "honest,nan,shape,crash,empty,slow",
            "num-server-rounds": 2,
            "round-timeout": 15,
            "local-epochs": 1,
            "db": db,
        }
    )
    record = run_simulation(config, app_dir=hostile_app)
    assert record.status == "finished"
    with LedgerRepository.open(db) as repo:
        rounds = repo.list_rounds(record.id)
        assert [r.num_rejected for r in rounds] == [3, 3]
        # Round 1 drops the crash and the overdue slow site.
        assert (rounds[0].num_applied, rounds[0].num_dropped) == (1, 2)
        slow = repo.list_updates(record.id, site="slow")
        assert slow[0].status == "dropped" and "no reply within 15 s" in (slow[0].reason or "")
        assert slow[0].bytes_up == 0 and slow[0].bytes_down > 0
        # The slow site gets a second message only once Flower has answered the first
        # (its TTL expired): never two at once. If it got one, it trained normally.
        assert len(slow) in (1, 2)
        assert all(u.status == "applied" for u in slow[1:])
        assert rounds[1].num_applied == len(slow)
        # No poisoned update entered the model: its loss stays finite (NaN is stored as
        # null) and falls as the honest site trains it.
        losses = [r.metrics["loss"] for r in rounds]
        assert all(loss is not None and np.isfinite(loss) for loss in losses)
        assert losses[1] < losses[0]
        reasons = {
            u.site: (u.status, u.reason or "") for u in repo.list_updates(record.id, round=2)
        }
        crashed = repo.list_updates(record.id, site="crash")
    # The crash, in round 1, benched the site for round 2 (flplatform/engine/bench.py).
    assert [(u.round, u.status) for u in crashed] == [(1, "dropped")]
    assert "disk on fire" in (crashed[0].reason or "")
    assert (crashed[0].reason or "").endswith("; benched for the next 1 round")
    assert "crash" not in reasons
    assert reasons["honest"][0] == "applied"
    assert reasons["nan"][0] == "rejected" and "NaN or Inf" in reasons["nan"][1]
    assert reasons["shape"][0] == "rejected" and "shape (3, 3)" in reasons["shape"][1]
    assert reasons["empty"][0] == "rejected" and "'arrays'" in reasons["empty"][1]


@pytest.mark.usefixtures("flplatform_home")
def test_one_file_per_site_partition(tmp_path: Path) -> None:
    split = tmp_path / "split"
    made = runner.invoke(app, ["data", "split", "--out", str(split), "--sites", "lab-a,lab-b"])
    assert made.exit_code == 0, made.output
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--partition",
            "files",
            "--dataset",
            str(split),
            "--rounds",
            "2",
            "--local-epochs",
            "1",
            "--db",
            db,
        ],
    )
    assert result.exit_code == 0, result.output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        sites = {s.name: s for s in repo.list_sites(run.id)}
        assert set(sites) == {"lab-a", "lab-b"}  # the split's names, in its files
        for name, site in sites.items():
            n = len(np.load(split / f"{name}.npz")["y"])
            assert site.num_examples == n - int(n * 0.1)
        assert [r.num_applied for r in repo.list_rounds(run.id)] == [2, 2]
