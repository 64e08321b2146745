"""A sweep for real: two runs in one Flower simulation end exactly as the same runs alone.

One ``run_sweep`` of two members (different seeds and synchrony modes, the first one
k-async, so that stragglers are still in flight when it ends) and the second one as a solo
simulation: the second member's final model equals its solo run's bit for bit (it is the
one that could inherit the first's stragglers, site state or data keys), so do its rounds'
metrics, and the ledger records each member with its own options and name. (Two Flower
start-ups, not three: the first member has nothing before it to differ by.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flplatform.app.config import RunConfig
from flplatform.cli.export import model_arrays
from flplatform.launch.simulation import run_simulation, run_sweep
from flplatform.run.ledger import load_checkpoint
from storage import LedgerRepository
from strategies.mods.snapshots import safe_name, state_root

pytestmark = pytest.mark.slow

BASE = {
    "sites": "london,ohio,california",
    "num-server-rounds": 3,
    "local-steps": 3,
    "local-epochs": 0,
    "network": "world",
    "compute-model": "exponential",
}
MEMBERS = [
    {"sync": "k-async", "k": 2, "seed": 1, "name": "sweep k-async seed=1"},
    {"sync": "sync", "seed": 2, "codec": "topk:0.1", "name": "sweep sync seed=2"},
]


def _final_model(db: str, run_id: int) -> dict[str, np.ndarray]:
    with LedgerRepository.open(db) as repository:
        _, state = load_checkpoint(repository, run_id)
    return dict(model_arrays(state, f"run {run_id}"))


def _metrics(db: str, run_id: int) -> list[dict[str, float | None]]:
    with LedgerRepository.open(db) as repository:
        return [r.metrics for r in repository.list_rounds(run_id)]


@pytest.mark.usefixtures("flplatform_home")
def test_a_sweep_runs_each_member_as_it_would_run_alone(tmp_path: Path) -> None:
    swept_db = f"sqlite:///{tmp_path / 'sweep.db'}"
    solo_db = f"sqlite:///{tmp_path / 'solo.db'}"
    members = [RunConfig.from_mapping({**BASE, **member, "db": swept_db}) for member in MEMBERS]

    records = run_sweep(members, poll_interval=0.2)
    solo = run_simulation(RunConfig.from_mapping({**BASE, **MEMBERS[1], "db": solo_db}))

    assert [r.status for r in records] == ["finished", "finished"]
    assert [r.name for r in records] == [m["name"] for m in MEMBERS]
    for member, record in zip(members, records, strict=True):
        # Each member is recorded with its own options: its tag, the ledger, its name.
        assert record.config == {
            **member.to_run_config(),
            "run-tag": record.tag,
            "db": record.config["db"],
            "name": member.name,
        }
        assert RunConfig.from_mapping(record.config).sweep == ""
    record = records[1]
    swept, alone = _final_model(swept_db, record.id), _final_model(solo_db, solo.id)
    assert list(swept) == list(alone)
    for name, array in alone.items():
        assert np.array_equal(swept[name], array), (record.name, name)
    assert _metrics(swept_db, record.id) == _metrics(solo_db, solo.id)
    assert record.final_metrics == solo.final_metrics
    # Finished runs cannot be resumed: the sites' snapshots of them (top-k residuals) are gone.
    root = state_root({})
    assert not [r.tag for r in (*records, solo) if (root / safe_name(r.tag or "")).exists()]
    # The members differ (seed, mode): the comparison is not of one model with itself.
    first, second = (_final_model(swept_db, r.id) for r in records)
    assert not all(np.array_equal(first[name], second[name]) for name in first)
