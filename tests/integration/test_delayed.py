"""Delayed compensated updates in a real Flower simulation on the world network."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from storage import LedgerRepository

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("flplatform_home")]
runner = CliRunner()


def test_delayed_updates_hide_round_trips_on_the_world_network(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["simulate", "--strategy", "delayed", "--delay", "2", "--period", "20"]
    result = runner.invoke(app, [*args, "--network", "world", "--rounds", "6", "--db", db])
    assert result.exit_code == 0, result.output
    assert "D=2" in result.output

    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished" and run.config["strategy"] == "delayed"
        rounds = repo.list_rounds(run.id)
        assert [r.model_version for r in rounds] == [1, 2, 3, 4, 5, 6]
        assert rounds[-1].metrics["accuracy"] > 0.5
        updates = repo.list_updates(run.id)
        assert all(u.status == "applied" for u in updates)
        by_site = defaultdict(list)
        for u in updates:
            by_site[u.site].append(u)
            # The site applied the average D rounds before its period (fewer at the start).
            assert u.delay == min(2, u.period - 1)
            assert u.average_applied == u.period - 1 - u.delay
            assert u.version_trained_on == u.average_applied
        overlapped = 0
        for site, rows in by_site.items():
            rows.sort(key=lambda u: u.period)
            assert [u.period for u in rows] == [1, 2, 3, 4, 5, 6], site
            for before, after in zip(rows, rows[1:], strict=False):
                # Pipelined: the next period's model left the server before this
                # period's update had landed there, and never before that model existed.
                overlapped += after.virtual_dispatched_at < before.virtual_arrived_at
                formed = {r.model_version: r.virtual_finished_at for r in rounds}
                assert after.virtual_dispatched_at >= formed.get(after.average_applied, 0.0) - 1e-9
        assert overlapped > 0

    shown = runner.invoke(app, ["history", "sites", str(run.id), "--db", db, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    sites = json.loads(shown.output)
    # Periods 1, 2, 3..6 applied averages 0, 1, 2 rounds old: mean (0 + 1 + 4·2) / 6.
    assert all(s["mean_delay"] == pytest.approx(1.5) for s in sites)
