"""Raw tabular features diverge, the run says so at once, and the option it names fixes it.

Real Flower simulations of scikit-learn's wine data (bundled with scikit-learn: nothing is
downloaded), unscaled, one ``.npz`` file per site: its proline column is in the hundreds, so
round 1's train loss reaches about 1e5 and the model then predicts the majority class.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_wine
from typer.testing import CliRunner

from clients.site_files import write_site_files
from flplatform.cli.app import app
from flplatform.core import keys
from storage import LedgerRepository

pytestmark = pytest.mark.slow
runner = CliRunner()
SITES = ("lab-a", "lab-b")


@pytest.fixture
def wine_sites(tmp_path: Path) -> Path:
    """Unscaled wine split into one file per site (and the held-out test file)."""
    data = load_wine()
    np.savez(tmp_path / "wine.npz", x=data.data, y=data.target)
    split = tmp_path / "split"
    write_site_files(str(tmp_path / "wine.npz"), split, sites=SITES, scheme="iid", seed=0)
    return split


def simulate(split: Path, db: str, *extra: str) -> str:
    args = ["simulate", "--partition", "files", "--dataset", str(split), "--rounds", "3"]
    result = runner.invoke(app, [*args, "--db", db, *extra])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.usefixtures("flplatform_home")
def test_raw_features_are_reported_as_diverged_with_the_fix(
    tmp_path: Path, wine_sites: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    output = simulate(wine_sites, db)
    # On the progress display, as round 1 is shown, and under the rounds table.
    assert "warning: round 1: training diverged: train loss" in output
    assert "Run 1 warning: round 1: training diverged" in output
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        # The run goes on and finishes; its note says what happened and what to do.
        assert run.status == "finished"
        note = run.error or ""
        assert note.startswith("round 1: training diverged: train loss")
        assert "more than 10× the first loss" in note
        assert "the features of site(s) lab-a (" in note and "lab-b (" in note
        assert "far from unit scale" in note and "--standardize-features" in note
        # Each site said how far its features are from unit scale (proline: about 800).
        scales = [s.profile["feature_scale"] for s in repo.list_sites(run.id)]
        assert all(scale > 100 for scale in scales)
        (first, *_) = repo.list_rounds(run.id)
        assert first.train_loss is not None and first.train_loss > 1000
    listed = runner.invoke(app, ["history", "runs", "--db", db])
    assert "round 1: training diverged" in listed.output


@pytest.mark.usefixtures("flplatform_home")
def test_standardised_features_train_without_a_report(tmp_path: Path, wine_sites: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    output = simulate(wine_sites, db, "--standardize-features", "--fraction-evaluate", "1")
    assert "diverged" not in output
    labels = np.concatenate([np.load(wine_sites / f"{s}.npz")["y"] for s in SITES])
    majority = np.bincount(labels).max() / len(labels)  # about 0.4
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.error) == ("finished", None)
        assert all(
            s.profile["feature_scale"] == pytest.approx(1.0, abs=1e-3)
            for s in repo.list_sites(run.id)
        )
        rounds = repo.list_rounds(run.id)
        # The sites evaluate on their own standardised validation slices; the server has
        # no unscaled test score to give.
        assert rounds[-1].metrics.get(keys.ACCURACY) is None
        accuracy = rounds[-1].metrics[keys.SITE_ACCURACY]
        assert accuracy is not None and accuracy > majority + 0.25
        assert all(r.train_loss is not None and r.train_loss < 2.0 for r in rounds)
