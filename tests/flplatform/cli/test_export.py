"""`flplatform export` and `flplatform history checkpoints|events` on a ledger with checkpoints."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flplatform.engine.events import RoundSummary
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from tests.helpers.cli import invoke, one_error_line


def small_model(seed: int) -> torch.nn.Module:
    """Weights, a float64 bias, and BatchNorm buffers (an int64 counter among them)."""
    torch.manual_seed(seed)
    norm = torch.nn.BatchNorm2d(3)
    linear = torch.nn.Linear(12, 2)
    linear.bias = torch.nn.Parameter(linear.bias.detach().double())
    norm.num_batches_tracked = torch.tensor(7)
    norm.running_mean = torch.arange(3.0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), norm, torch.nn.Flatten(), linear)
    return model


@pytest.fixture
def ledger(
    sqlite_ledger: str, tmp_path: Path
) -> Iterator[tuple[str, dict[int, dict[str, torch.Tensor]]]]:
    """Run 1: four rounds with checkpoints (kept every 2, at most 2), finished; run 2: none."""
    url = sqlite_ledger
    models: dict[int, dict[str, torch.Tensor]] = {}
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="digits", strategy="local-sgd", seed=1, config={}, num_rounds_planned=4
        )
        sink = SqlLedger(
            repo, run_id, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, keep_checkpoints=2
        )
        for step in (1, 2, 3, 4):
            state_dict = small_model(step).state_dict()
            models[step] = {k: v.clone() for k, v in state_dict.items()}
            state = {
                "kind": "flplatform-run-state",
                "server_round": step,
                "model_version": step,
                "model": ArrayRecord(state_dict),
                "engine": {"config": ConfigRecord({"lr": 0.1})},
            }
            summary = RoundSummary(step, step, t0 + step, t0 + step + 0.5, {}, None, ())
            sink.record_round(summary, state)
        repo.add_event(run_id, "resumed", {"status": "failed", "owner": "host:1"})
        sink.finish()
        repo.finish_run(run_id, status="finished")
        repo.create_run(name="old", strategy="fedavg", seed=1, config={}, num_rounds_planned=2)
    yield url, models


def test_export_pt_loads_into_the_model_with_equal_tensors(ledger: Any, tmp_path: Path) -> None:
    url, models = ledger
    out = tmp_path / "model.pt"

    result = invoke(["export", "1", "--out", str(out), "--db", url])

    assert result.exit_code == 0, result.output
    assert "after round 4" in result.output
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == list(models[4])  # the model's own key order
    fresh = small_model(seed=99)
    fresh.load_state_dict(loaded)  # strict: every key, every shape
    for name, tensor in fresh.state_dict().items():
        assert tensor.dtype == models[4][name].dtype, name
        assert torch.equal(tensor, models[4][name]), name


def test_export_npz_of_an_earlier_round_has_equal_arrays(ledger: Any, tmp_path: Path) -> None:
    url, models = ledger
    out = tmp_path / "model.NPZ"

    result = invoke(["export", "1", "--round", "2", "--out", str(out), "--db", url])

    assert result.exit_code == 0, result.output
    with np.load(out, allow_pickle=False) as arrays:
        assert list(arrays.keys()) == list(models[2])
        for name, tensor in models[2].items():
            assert arrays[name].dtype == tensor.numpy().dtype, name
            assert np.array_equal(arrays[name], tensor.numpy()), name


def test_export_refuses_to_overwrite_without_force(ledger: Any, tmp_path: Path) -> None:
    url, models = ledger
    out = tmp_path / "model.pt"
    out.write_bytes(b"mine")

    result = invoke(["export", "latest", "--out", str(out), "--db", url])
    assert result.exit_code == 2
    assert "already exists; pass --force" in one_error_line(result.output)
    assert out.read_bytes() == b"mine"

    result = invoke(["export", "1", "--out", str(out), "--db", url, "--force"])
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.load(out, weights_only=True)["3.weight"], models[4]["3.weight"])


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["7"], 5, "run 7 does not exist"),
        (
            ["1", "--round", "1"],
            5,
            "run 1 has no checkpoint of round 1; run 1 has checkpoints of rounds 2, 4",
        ),
        (["2"], 5, "run 2 has no checkpoints"),
        (["nope"], 2, "RUN must be a run id"),
    ],
)
def test_export_errors_are_one_line(
    ledger: Any, tmp_path: Path, args: list[str], code: int, expected: str
) -> None:
    url, _ = ledger
    out = tmp_path / "model.pt"
    result = invoke(["export", *args, "--out", str(out), "--db", url])
    assert result.exit_code == code, result.output
    assert expected in one_error_line(result.output)
    assert not out.exists()


def test_export_names_a_missing_file_and_a_bad_extension(ledger: Any, tmp_path: Path) -> None:
    url, _ = ledger
    with LedgerRepository.open(url) as repo:
        Path(repo.list_checkpoints(1)[-1].path).unlink()

    result = invoke(["export", "1", "--out", str(tmp_path / "m.pt"), "--db", url])
    assert result.exit_code == 4
    line = one_error_line(result.output)
    assert "round 4 of run 1" in line and "does not exist (was it moved or deleted?)" in line

    result = invoke(["export", "1", "--out", str(tmp_path / "m.onnx"), "--db", url])
    assert result.exit_code == 2
    assert "--out must end in .pt or .npz" in one_error_line(result.output)

    result = invoke(["export", "1", "--out", str(tmp_path / "no" / "m.pt"), "--db", url])
    assert result.exit_code == 2
    assert "does not exist" in one_error_line(result.output)


def test_export_refuses_a_checkpoint_without_a_model(ledger: Any, tmp_path: Path) -> None:
    url, _ = ledger
    from flplatform.core.checkpoint import write_state

    with LedgerRepository.open(url) as repo:
        write_state(repo.list_checkpoints(1)[0].path, {"kind": "something else"})
    result = invoke(["export", "1", "--round", "2", "--out", str(tmp_path / "m.pt"), "--db", url])
    assert result.exit_code == 4
    assert "holds no global model" in one_error_line(result.output)


def test_history_checkpoints_table_json_csv(ledger: Any) -> None:
    url, _ = ledger
    table = invoke(["history", "checkpoints", "1", "--db", url])
    assert table.exit_code == 0, table.output
    assert "round-000004.npz" in table.output and "round-000002.npz" in table.output

    rows = json.loads(invoke(["history", "checkpoints", "1", "--db", url, "-f", "json"]).output)
    assert [(r["round"], r["model_version"], r["kept"]) for r in rows] == [
        (2, 2, True),
        (4, 4, True),
    ]
    assert all(r["file_present"] and r["size_bytes"] > 0 for r in rows)

    out = invoke(["history", "checkpoints", "1", "--db", url, "-f", "csv"]).output
    assert [r["round"] for r in csv.DictReader(io.StringIO(out))] == ["2", "4"]

    Path(rows[0]["path"]).unlink()
    assert "(missing)" in invoke(["history", "checkpoints", "1", "--db", url]).output
    empty = invoke(["history", "checkpoints", "2", "--db", url])
    assert "Run 2 has no checkpoints." in empty.output


def test_history_events_table_json_csv(ledger: Any) -> None:
    url, _ = ledger
    table = invoke(["history", "events", "1", "--db", url])
    assert table.exit_code == 0, table.output
    assert "resumed" in table.output and "host:1" in table.output

    rows = json.loads(invoke(["history", "events", "1", "--db", url, "-f", "json"]).output)
    assert [(r["kind"], r["detail"]) for r in rows] == [
        ("resumed", {"status": "failed", "owner": "host:1"})
    ]
    out = invoke(["history", "events", "1", "--db", url, "-f", "csv"]).output
    [row] = list(csv.DictReader(io.StringIO(out)))
    assert json.loads(row["detail"]) == {"status": "failed", "owner": "host:1"}

    missing = invoke(["history", "events", "9", "--db", url])
    assert missing.exit_code == 5 and "run 9 does not exist" in one_error_line(missing.output)


def test_history_export_gives_mlflow_the_final_model(ledger: Any, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    url, models = ledger
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = invoke(["history", "export", "1", "--db", url, "--mlflow", uri])
    assert result.exit_code == 0, result.output
    assert "no checkpoint" not in result.output
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("flplatform").experiment_id])
    path = client.download_artifacts(run.info.run_id, "model.pt", str(tmp_path / "back"))
    exported = torch.load(path)
    assert list(exported) == list(models[4])  # the last round's model, in its key order
    for name, tensor in models[4].items():
        assert torch.equal(exported[name], tensor), name
