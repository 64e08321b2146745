"""Sites are named by their registration in a deployment, whatever they claim."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry
from storage import LedgerRepository
from tests.helpers.engine import engine_for
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import site

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})


def test_registered_names_win_over_claims_and_the_claim_is_kept(
    ledger: tuple[LedgerRepository, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "registry.json"
    SiteRegistry(
        (RegisteredSite("london", 11, "SHA256:l"), RegisteredSite("ohio", 12, "SHA256:o"))
    ).write(path)
    monkeypatch.setenv(REGISTRY_ENV, str(path))
    # Node 11 holds london's key but calls itself tokyo; node 12 tells the truth.
    grid = ScriptedGrid({11: site("tokyo"), 12: site("ohio")})
    engine_for(grid, ledger).run(MODEL, num_rounds=1)
    repo, run_id = ledger
    sites = {s.name: s for s in repo.list_sites(run_id)}
    assert set(sites) == {"london", "ohio"}
    assert sites["london"].node_id == 11
    assert sites["london"].profile["claimed_name"] == "tokyo"
    assert "claimed_name" not in sites["ohio"].profile
    assert {u.site for u in repo.list_updates(run_id)} == {"london", "ohio"}


def test_without_a_registry_sites_are_named_as_they_say(
    ledger: tuple[LedgerRepository, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    grid = ScriptedGrid({11: site("tokyo"), 12: site("ohio")})
    engine_for(grid, ledger).run(MODEL, num_rounds=1)
    repo, run_id = ledger
    assert {s.name for s in repo.list_sites(run_id)} == {"tokyo", "ohio"}
