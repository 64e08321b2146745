"""A run that loses a site says so at once: a warning and a ledger event when the
SuperLink stops listing a site's SuperNode, and again when it is listed back.

The real ``RoundEngine`` and local-SGD strategy over a scripted grid whose node list
changes between rounds (a deployed SuperNode that dies leaves Flower's online list),
writing a real SQLite ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import pytest
from flwr.app import Message

from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import SITE_BACK_EVENT, SITE_LOST_EVENT
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.scripted_sites import MODEL, good, scripted

pytestmark = pytest.mark.usefixtures("task_identity")


class ListedGrid(ScriptedGrid):
    """A grid that lists only the nodes in ``listed`` (the SuperLink's online nodes)."""

    def __init__(self, behaviours: dict, listed: set[int]) -> None:  # type: ignore[type-arg]
        super().__init__(behaviours)
        self.listed = listed

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.listed)


def test_a_site_that_leaves_and_comes_back_is_said_and_recorded_each_time(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    listed = {1, 2, 3}
    trained = 0

    def london(msg: Message) -> Message:
        # ohio's SuperNode is gone after london's first update and back after its third
        nonlocal trained
        trained += 1
        if trained == 1:
            listed.discard(2)
        if trained == 3:
            listed.add(2)
        return good(msg)

    sites = {1: scripted("london", london), 2: scripted("ohio", good), 3: scripted("tokyo", good)}
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=4
        )
        engine = RoundEngine(
            ListedGrid(sites, listed),
            LocalSGDAveraging(),
            ledger=SqlLedger(repository, run_id),
            required_sites=3,
            poll_interval=0.0,
        )
        with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
            engine.run(MODEL, num_rounds=4)
        rounds = repository.list_rounds(run_id)
        events = [(e.kind, e.detail) for e in repository.list_events(run_id)]
        trained_by = {
            r.round: sorted(u.site for u in repository.list_updates(run_id) if u.round == r.round)
            for r in rounds
        }

    assert [r.num_applied for r in rounds] == [3, 2, 2, 3]
    assert trained_by[2] == trained_by[3] == ["london", "tokyo"]
    assert events == [
        (SITE_LOST_EVENT, {"site": "ohio", "round": 2, "connected": 2, "sites": 3}),
        (SITE_BACK_EVENT, {"site": "ohio", "round": 4, "connected": 3, "sites": 3}),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 2: site ohio left" in w and "2 of 3 sites connected" in w for w in warnings)
    assert any("round 4: site ohio is back (3 of 3 sites connected)" in w for w in warnings)


def test_a_run_that_keeps_its_sites_records_no_presence_event(sqlite_ledger: str) -> None:
    sites = {1: scripted("london", good), 2: scripted("ohio", good)}
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=3
        )
        RoundEngine(
            ListedGrid(sites, {1, 2}),
            LocalSGDAveraging(),
            ledger=SqlLedger(repository, run_id),
            required_sites=2,
            poll_interval=0.0,
        ).run(MODEL, num_rounds=3)
        assert repository.list_events(run_id) == []


def test_a_site_that_dies_holding_work_is_said_before_its_work_times_out(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flplatform.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PRESENCE_CHECK_SECONDS", 0.1)
    listed = {1, 2}
    dropped_at: list[float] = []
    recorded_at: list[float] = []
    trained = 0

    def ohio(msg: Message) -> Message | None:
        # answers round 1; dies on receiving its round-2 work (never answers it)
        nonlocal trained
        trained += 1
        if trained == 1:
            return good(msg)
        listed.discard(2)
        dropped_at.append(time.monotonic())
        return None

    class TimedLedger(SqlLedger):
        def record_event(self, kind: str, detail: dict) -> None:  # type: ignore[type-arg]
            recorded_at.append(time.monotonic())
            super().record_event(kind, detail)

    sites = {1: scripted("london", good), 2: scripted("ohio", ohio)}
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=2
        )
        RoundEngine(
            ListedGrid(sites, listed),
            LocalSGDAveraging(),
            ledger=TimedLedger(repository, run_id),
            required_sites=2,
            poll_interval=0.01,
            round_timeout=4.0,
        ).run(MODEL, num_rounds=2)
        events = [
            (e.kind, e.detail["site"], e.detail["round"]) for e in repository.list_events(run_id)
        ]
        ohio_round_2 = [
            u for u in repository.list_updates(run_id) if u.round == 2 and u.site == "ohio"
        ]
    assert events == [(SITE_LOST_EVENT, "ohio", 2)]
    assert recorded_at[0] - dropped_at[0] < 2.0  # said within a few checks, not after 4 s
    assert [u.status for u in ohio_round_2] == ["dropped"]  # its work still timed out
