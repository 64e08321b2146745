"""A user's existing Flower ClientApp (no flplatform code) joins an flplatform server."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from flplatform.app.config import RunConfig
from flplatform.launch.simulation import run_simulation
from storage import LedgerRepository

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plain_flower_client"


def test_example_config_is_a_valid_run_config() -> None:
    pyproject = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    RunConfig.from_mapping(pyproject["tool"]["flwr"]["app"]["config"])
    assert "flplatform" not in (EXAMPLE / "plain_client.py").read_text().split('"""', 2)[2]


@pytest.mark.slow
def test_plain_flower_clientapp_trains_with_local_sgd(
    tmp_path: Path, flplatform_home: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    config = RunConfig.from_mapping(
        {"sites": "a,b,c", "num-server-rounds": 2, "fraction-evaluate": 1.0, "db": db}
    )
    record = run_simulation(config, app_dir=EXAMPLE)
    assert record.status == "finished"
    with LedgerRepository.open(db) as repo:
        sites = repo.list_sites(record.id)
        # It answers no site-info query, so its sites are named after their node ids.
        assert all(s.name.startswith("node-") for s in sites) and len(sites) == 3
        rounds = repo.list_rounds(record.id)
        assert [r.num_applied for r in rounds] == [3, 3]
        assert rounds[-1].metrics["accuracy"] > 0.3
        assert rounds[-1].metrics["site_accuracy"] > 0.3  # its eval_acc, aggregated
        updates = repo.list_updates(record.id)
        assert all(u.train_loss is not None and u.num_examples for u in updates)
    # Flower's tracebacks for the query it cannot answer are not in the run's log.
    logs = list((flplatform_home / "logs").glob("*.log"))
    assert logs and not any("Traceback" in log.read_text() for log in logs)
