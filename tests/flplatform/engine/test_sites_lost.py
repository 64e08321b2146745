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
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.checkpoint import CheckpointError
from flplatform.engine import APPLIED, PeriodSync, RoundSummary, Synchrony
from flplatform.engine import engine as engine_module
from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import SITE_BACK_EVENT, SITE_LOST_EVENT
from flplatform.engine.guard import UpdateGuard
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository, RoundRecord, UpdateRecord
from strategies.delayed import DelayedCompensated
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.delayed_sites import QuadraticSite, context
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid
from tests.helpers.scripted_sites import MODEL, expired, good, scripted

pytestmark = pytest.mark.usefixtures("task_identity")


class ListedGrid(ScriptedGrid):
    """A grid that lists only the nodes in ``listed`` (the SuperLink's online nodes)."""

    def __init__(self, behaviours: dict, listed: set[int]) -> None:  # type: ignore[type-arg]
        super().__init__(behaviours)
        self.listed = listed

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.listed)


@dataclass
class ListedRun:
    """What a run over a ``ListedGrid`` left: the engine, and the ledger's rows."""

    engine: RoundEngine
    rounds: list[RoundRecord]
    updates: list[UpdateRecord]
    events: list[tuple[str, dict[str, Any]]]
    sites: dict[str, int]  # name → node id
    profiles: dict[str, dict[str, Any]]  # name → the profile the ledger has


def run_listed(
    ledger: str,
    sites: dict[int, Behaviour],
    listed: set[int],
    rounds: int,
    strategy: LocalSGDAveraging | None = None,
    **options: Any,
) -> ListedRun:
    """Local-SGD (or ``strategy``) for ``rounds`` rounds over ``sites``, of which the
    SuperLink lists ``listed`` (the sites change it as they go), into a new run of
    ``ledger``; the sites listed at the start are required."""
    with LedgerRepository.open(ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=rounds
        )
        engine = RoundEngine(
            ListedGrid(sites, listed),
            strategy or LocalSGDAveraging(),
            ledger=SqlLedger(repository, run_id),
            required_sites=len(listed),
            poll_interval=0.0,
            **options,
        )
        engine.run(MODEL, num_rounds=rounds)
        return ListedRun(
            engine,
            repository.list_rounds(run_id),
            repository.list_updates(run_id),
            [(e.kind, e.detail) for e in repository.list_events(run_id)],
            {site.name: site.node_id for site in repository.list_sites(run_id)},
            {site.name: site.profile for site in repository.list_sites(run_id)},
        )


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
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        run = run_listed(sqlite_ledger, sites, listed, 4)
    trained_by = {
        r.round: sorted(u.site for u in run.updates if u.round == r.round) for r in run.rounds
    }

    assert [r.num_applied for r in run.rounds] == [3, 2, 2, 3]
    assert trained_by[2] == trained_by[3] == ["london", "tokyo"]
    assert run.events == [
        (SITE_LOST_EVENT, {"site": "ohio", "round": 2, "connected": 2, "sites": 3}),
        (SITE_BACK_EVENT, {"site": "ohio", "round": 4, "connected": 3, "sites": 3}),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("round 2: site ohio left" in w and "2 of 3 sites connected" in w for w in warnings)
    assert any("round 4: site ohio is back (3 of 3 sites connected)" in w for w in warnings)


def test_a_run_that_keeps_its_sites_records_no_presence_event(sqlite_ledger: str) -> None:
    sites = {1: scripted("london", good), 2: scripted("ohio", good)}
    assert run_listed(sqlite_ledger, sites, {1, 2}, 3).events == []


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


def test_a_site_whose_supernode_restarts_keeps_its_place_and_the_run_resumes(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    """ohio's SuperNode dies after its first update and starts again as node 4 (a crash,
    a reboot; Flower gives it a new node id). It takes up ohio's place between rounds: one
    site in the ledger, two events, and a checkpoint that a resume matches by name. Before,
    it joined as a site of its own, "ohio-4", and the run could never be resumed: ohio of
    the checkpoint never came back (found by a review)."""
    listed = {1, 2, 3}

    def restarts(msg: Message) -> Message:
        listed.discard(2)
        listed.add(4)
        return good(msg)

    def on_a_gpu(msg: Message) -> Message:  # ohio, restarted: it says what it runs on
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: "ohio", keys.DEVICE: "cuda_0"})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        return good(msg)

    sites = {
        1: scripted("london", good),
        2: scripted("ohio", restarts),
        3: scripted("tokyo", good),
        4: on_a_gpu,
    }
    seen: list[RoundSummary] = []
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        run = run_listed(sqlite_ledger, sites, listed, 3, on_round=seen.append)
    assert [s.warning for s in seen] == [None, None, None]  # (it said "cannot be resumed")
    assert run.profiles["ohio"] == {"device": "cuda_0"}  # what the new node said (it was {})

    assert [r.num_applied for r in run.rounds] == [3, 3, 3]
    assert sorted((u.round, u.site) for u in run.updates if u.site == "ohio") == [
        (1, "ohio"),
        (2, "ohio"),
        (3, "ohio"),
    ]
    assert run.sites == {"london": 1, "ohio": 4, "tokyo": 3}
    assert run.events == [
        (SITE_LOST_EVENT, {"site": "ohio", "round": 2, "connected": 2, "sites": 3}),
        (
            SITE_BACK_EVENT,
            {"site": "ohio", "round": 2, "connected": 3, "sites": 3, "restarted": 1},
        ),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("site ohio is back: its SuperNode started again" in w for w in warnings)

    # A resume after a server restart: every SuperNode with a new id again, found by name.
    state = run.engine.state_dict()
    assert sorted((s["name"], s["node_id"]) for s in state["engine"]["sites"]) == [
        ("london", 1),
        ("ohio", 4),
        ("tokyo", 3),
    ]
    again = {11: scripted("london", good), 12: scripted("ohio", good), 13: scripted("tokyo", good)}
    resumed = RoundEngine(
        ScriptedGrid(again), LocalSGDAveraging(), required_sites=3, poll_interval=0.0
    )
    assert resumed.resume_from(state) == {1: 11, 4: 12, 3: 13}


def test_a_lone_site_that_restarts_holding_work_takes_its_place_and_trains_on(
    sqlite_ledger: str,
) -> None:
    """The federation's one site, ohio, dies holding its round-2 work and starts again at
    once as node 3. The work is given up on at the round timeout; Flower answers for it
    only later (the node gone). The new node takes ohio's place at the next round, as the
    old node's message, given up on, is no longer work (it waited for Flower's answer
    before, and the run failed: no site could be given work; found by a review)."""
    listed = {2}
    new_trained = 0

    def dies_holding_work(msg: Message) -> Message | None:
        listed.discard(2)
        listed.add(3)
        return None if new_trained < 2 else expired(msg)  # Flower answers in round 4

    def restarted(msg: Message) -> Message:
        nonlocal new_trained
        new_trained += 1
        return good(msg)

    sites = {2: scripted("ohio", good, dies_holding_work), 3: scripted("ohio", restarted)}
    run = run_listed(sqlite_ledger, sites, listed, 5, round_timeout=0.3)
    ohio = {u.round: u.status for u in run.updates if u.site == "ohio"}
    assert ohio == {1: "applied", 2: "dropped", 3: "applied", 4: "applied", 5: "applied"}
    events = [(kind, d["round"], d.get("restarted")) for kind, d in run.events]
    assert events == [(SITE_LOST_EVENT, 3, None), (SITE_BACK_EVENT, 3, 1)]
    assert run.sites == {"ohio": 3}
    resumed = RoundEngine(
        ScriptedGrid({12: scripted("ohio", good)}),
        LocalSGDAveraging(),
        required_sites=1,
        poll_interval=0.0,
    )
    assert resumed.resume_from(run.engine.state_dict()) == {3: 12}


def delayed_run(*, restart: bool) -> tuple[np.ndarray, DelayedCompensated, list[RoundSummary]]:
    """Delayed updates (D = 1) on three quadratic sites; with ``restart``, s2's SuperNode
    starts again as node 4 after its second update, its own state kept (the same site
    object: its snapshots on its disk)."""
    targets = np.random.default_rng(7).normal(size=(3, 4))
    quadratic = {n: QuadraticSite(f"s{n}", targets[n - 1], state=context(n)) for n in (1, 2, 3)}
    listed = {1, 2, 3}
    trained = 0

    def s2(msg: Message) -> Message:
        nonlocal trained
        if msg.metadata.message_type == MessageType.TRAIN:
            trained += 1
            if restart and trained == 2:
                listed.discard(2)
                listed.add(4)
        return quadratic[2](msg)

    behaviours = {1: quadratic[1], 2: s2, 3: quadratic[3], 4: quadratic[2]}
    strategy = DelayedCompensated(delay=1, num_rounds=5)
    seen: list[RoundSummary] = []
    engine = RoundEngine(
        ListedGrid(behaviours, listed),
        strategy,
        policy=PeriodSync(),
        guard=UpdateGuard(),
        required_sites=3,
        poll_interval=0.0,
        on_round=seen.append,
    )
    engine.run(
        ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
        num_rounds=5,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 3}),
    )
    return record_to_arrays(engine.arrays)["w"], strategy, seen


def test_a_restarted_site_of_delayed_updates_goes_on_as_if_it_had_not_restarted() -> None:
    """The strategy's record of the site (its periods sent, answered and included: what
    its stale contribution is swapped against) moves to its new node, and the site's own
    state is on its disk: every period of s2 is applied, none resynced, and the run ends
    with the model of the run without the restart, bit for bit."""
    alone, _, _ = delayed_run(restart=False)
    restarted, strategy, seen = delayed_run(restart=True)
    s2 = [(u.period, u.status, u.reason) for s in seen for u in s.updates if u.site == "s2"]
    assert s2 == [(period, APPLIED, None) for period in range(1, 6)]
    assert sorted(strategy.state.replied) == [1, 3, 4]
    assert np.array_equal(restarted, alone)


def restarting_ohio(listed: set[int]) -> dict[int, Behaviour]:
    """london, ohio (node 2) and tokyo; ohio's SuperNode restarts after its first update:
    its new node 4 registers while Flower still lists node 2, whose heartbeat lapses at
    its next message (Flower answers for it)."""

    def registers_again(msg: Message) -> Message:
        listed.add(4)  # ohio's SuperNode is restarting: its new node registers
        return good(msg)

    def dead(msg: Message) -> Message:
        listed.discard(2)  # the dead node's heartbeat lapses; Flower answers for it
        return expired(msg)

    return {
        1: scripted("london", good),
        2: scripted("ohio", registers_again, dead),
        3: scripted("tokyo", good),
        4: scripted("ohio", good),
    }


def test_a_restarted_supernode_listed_beside_its_dead_one_waits_for_it_to_go(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An unauthenticated SuperNode that restarts registers anew while Flower still lists
    the dead one, until its heartbeat lapses (seen on a deployment with --insecure: the
    new node joined as "ohio-<id>", a fourth site). It now gets no work meanwhile, and
    takes ohio's place once the old node is gone and its work has ended."""
    listed = {1, 2, 3}
    seen: list[RoundSummary] = []
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        run = run_listed(sqlite_ledger, restarting_ohio(listed), listed, 4, on_round=seen.append)
    assert run.sites == {"london": 1, "ohio": 4, "tokyo": 3}
    ohio = {u.round: u.status for u in run.updates if u.site == "ohio"}
    assert ohio[1] == "applied" and ohio[2] != "applied" and ohio[3] == ohio[4] == "applied"
    events = [(kind, d.get("round"), d.get("restarted")) for kind, d in run.events]
    assert events == [(SITE_LOST_EVENT, 3, None), (SITE_BACK_EVENT, 3, 1)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("node 4 says it is site ohio, whose SuperNode is connected" in w for w in warnings)
    # a restart that took its place within CLAIM_WARNING_SECONDS is no run warning
    assert [s.warning for s in seen] == [None] * 4


def test_a_second_supernode_that_registered_while_the_site_blinked_off_is_said_too(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ohio's SuperNode drops off the list for a moment while it trains (a lapsed
    heartbeat), a second SuperNode named ohio registers meanwhile, and ohio's comes back
    under its node id and stays: the second idles beside it, and the run says so (it was
    timed only when it registered beside a connected site, and never said: a review)."""
    monkeypatch.setattr(engine_module, "CLAIM_WARNING_SECONDS", 0.0)
    listed = {1, 2, 3}
    second = scripted("ohio", good)
    asked: list[int] = []

    def second_ohio(msg: Message) -> Message | None:
        asked.append(1)  # the engine has heard of it (while ohio is off the list)
        return second(msg)

    def blinks_off(msg: Message) -> Message | None:
        listed.discard(2)
        listed.add(4)  # a second ohio registers while ohio is off the list
        return None  # still training: its work stays out

    def brings_ohio_back(msg: Message) -> Message:
        if asked:
            listed.add(2)
        return good(msg)

    sites = {
        1: scripted("london", good, brings_ohio_back),
        2: scripted("ohio", good, blinks_off, good),
        3: scripted("tokyo", good),
        4: second_ohio,
    }
    seen: list[RoundSummary] = []
    run = run_listed(
        sqlite_ledger, sites, listed, 10, policy=Synchrony("async"), on_round=seen.append
    )
    assert run.sites == {"london": 1, "ohio": 2, "tokyo": 3}
    said = [
        s.server_round for s in seen if s.warning and "node 4 says it is site ohio" in s.warning
    ]
    assert len(said) == 1, [(s.server_round, s.warning) for s in seen]


class StatelessAveraging(LocalSGDAveraging):
    """A strategy that cannot restore its state (a user's own, say)."""

    def load_state_dict(self, state: Any, *, nodes: Any = None) -> None:
        raise CheckpointError("this strategy keeps its state to itself")


def test_a_restart_under_a_strategy_that_cannot_hand_over_joins_as_a_site_of_its_own(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The take-over moves the strategy's state through its checkpoint; a strategy that
    cannot restore one leaves the restarted node to join as a site of its own, named
    apart, and the run goes on (as every restart did before the take-over)."""
    listed = {1, 2, 3}
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        run = run_listed(sqlite_ledger, restarting_ohio(listed), listed, 4, StatelessAveraging())
    assert run.sites == {"london": 1, "ohio": 2, "tokyo": 3, "ohio-4": 4}
    assert {u.round for u in run.updates if u.site == "ohio-4" and u.status == "applied"} >= {4}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "site ohio restarted as node 4, but the strategy cannot hand it the site's state" in w
        and "it joins as a new site" in w
        for w in warnings
    )


def test_a_second_supernode_given_a_sites_name_is_said_in_the_run_once_it_has_waited(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two SuperNodes started with one site name (under --insecure: names are not bound to
    keys). The second waits for the first to leave, as a restart does, with no work; once
    it has waited CLAIM_WARNING_SECONDS (Flower drops a dead node within about a minute),
    the run says so in its warnings, once (only the ServerApp's log said it before)."""
    monkeypatch.setattr(engine_module, "CLAIM_WARNING_SECONDS", 0.0)
    listed = {1, 2, 3}

    def starts_a_second_ohio(msg: Message) -> Message:
        listed.add(4)
        return good(msg)

    sites = {
        1: scripted("london", good),
        2: scripted("ohio", starts_a_second_ohio, good),
        3: scripted("tokyo", good),
        4: scripted("ohio", good),
    }
    seen: list[RoundSummary] = []
    run = run_listed(sqlite_ledger, sites, listed, 4, on_round=seen.append)
    assert run.sites == {"london": 1, "ohio": 2, "tokyo": 3}  # node 4 never took a place
    assert all(u.site != "ohio" or u.status == "applied" for u in run.updates)
    said = [
        s.server_round for s in seen if s.warning and "node 4 says it is site ohio" in s.warning
    ]
    assert said == [2]  # it registered in round 1; said at the next round's start, once
    assert "ohio's SuperNode has stayed connected" in (seen[1].warning or "")
    assert "two SuperNodes started with one site name?" in (seen[1].warning or "")


def test_of_two_restarts_in_a_row_the_latest_takes_the_sites_place(sqlite_ledger: str) -> None:
    """ohio's SuperNode crashes in a loop: node 4 registers, dies too, node 5 registers;
    Flower lists all of them for a while. Node 5, the latest, takes ohio's place; node 4
    never trains (it took ohio's place before, and node 5 joined as "ohio-5": found by a
    review)."""
    listed = {1, 2, 3}
    trained = 0

    def crash_loop(msg: Message) -> Message:
        nonlocal trained
        trained += 1
        if trained < 3:
            listed.add(3 + trained)  # restart 1, then restart 2, register
            return good(msg)
        listed.discard(2)  # the first dead node's heartbeat lapses at last
        return expired(msg)

    sites = {
        1: scripted("london", good),
        2: scripted("ohio", crash_loop),
        3: scripted("tokyo", good),
        4: scripted("ohio", lambda msg: None),  # answered who it is, then died
        5: scripted("ohio", good),
    }
    # (a dead node given work would hold a round for the round timeout)
    run = run_listed(sqlite_ledger, sites, listed, 6, round_timeout=2.0)
    assert run.sites == {"london": 1, "ohio": 5, "tokyo": 3}
    ohio = {u.round: u.status for u in run.updates if u.site == "ohio"}
    assert ohio[3] != "applied" and ohio[4] == ohio[5] == ohio[6] == "applied"
    again = {11: scripted("london", good), 15: scripted("ohio", good), 13: scripted("tokyo", good)}
    resumed = RoundEngine(
        ScriptedGrid(again), LocalSGDAveraging(), required_sites=3, poll_interval=0.0
    )
    assert resumed.resume_from(run.engine.state_dict()) == {1: 11, 5: 15, 3: 13}


def test_a_site_restarting_while_a_run_resumes_is_asked_once_and_takes_its_place() -> None:
    """A resumed run finds its sites by name, look after look: node 14 says it is ohio
    (ohio's SuperNode restarting) while node 12, ohio's, is still listed. It waits, is not
    asked again at every look (it was, and joined as "ohio-14" besides: found by a
    review), and takes ohio's place once node 12 is gone."""
    first = RoundEngine(
        ScriptedGrid(
            {1: scripted("london", good), 2: scripted("ohio", good), 3: scripted("tokyo", good)}
        ),
        LocalSGDAveraging(),
        required_sites=3,
        poll_interval=0.0,
    )
    first.run(MODEL, num_rounds=2)
    asked = 0

    def restarting_ohio(msg: Message) -> Message:
        nonlocal asked
        asked += msg.metadata.message_type == MessageType.QUERY
        return scripted("ohio", good)(msg)

    class Looks(ListedGrid):
        looks = 0

        def get_node_ids(self) -> Iterable[int]:
            self.looks += 1
            if self.looks == 2:
                self.listed.add(14)
            if self.looks == 4:  # tokyo comes back later: the resume looks again meanwhile
                self.listed.add(13)
            return sorted(self.listed)

    def dead(msg: Message) -> Message:
        grid.listed.discard(12)  # its heartbeat lapses; Flower answers for it
        return expired(msg)

    grid = Looks(
        {
            11: scripted("london", good),
            12: scripted("ohio", dead),
            13: scripted("tokyo", good),
            14: restarting_ohio,
        },
        {11, 12},
    )
    resumed = RoundEngine(
        grid, LocalSGDAveraging(), required_sites=3, poll_interval=0.0, round_timeout=2.0
    )
    resumed.run(MODEL, num_rounds=5, resume=first.state_dict())
    assert asked == 1
    assert {n: i.name for n, i in resumed.sites.infos().items()} == {
        11: "london",
        14: "ohio",
        13: "tokyo",
    }


def unnamed(msg: Message) -> Message:
    """A ClientApp with no query function: Flower answers the site query with an error."""
    if msg.metadata.message_type == MessageType.QUERY:
        return Message(Error(code=0, reason="no query function"), reply_to=msg)
    return good(msg)


def test_a_run_whose_sites_are_named_by_node_ids_says_it_cannot_be_resumed() -> None:
    """Sites that do not say their names are named by their Flower node ids, new at every
    start-up: the run says in its first round that it cannot be resumed, and a resume says
    why at once (it waited out the start-up timeout, 300 s by default, for sites named
    after the old ids; tried with a user's app)."""
    seen: list[RoundSummary] = []
    first = RoundEngine(
        ScriptedGrid({1: unnamed, 2: unnamed}),
        LocalSGDAveraging(),
        required_sites=2,
        poll_interval=0.0,
        on_round=seen.append,
    )
    first.run(MODEL, num_rounds=2)
    assert "2 site(s) are named by their Flower node ids" in (seen[0].warning or "")
    assert "cannot be resumed" in (seen[0].warning or "") and seen[1].warning is None

    def resumed_on(*nodes: int) -> dict[int, int]:
        engine = RoundEngine(
            ScriptedGrid(dict.fromkeys(nodes, unnamed)),
            LocalSGDAveraging(),
            required_sites=2,
            poll_interval=0.0,
            startup_timeout=1.0,
        )
        return engine.resume_from(first.state_dict())

    with pytest.raises(CheckpointError, match=r"cannot resume: 2 site\(s\) are named by their"):
        resumed_on(11, 12)
    # Where node ids outlive a restart (SuperNodes with keys, a SuperLink of one's own),
    # the same names come back and the run resumes.
    assert resumed_on(1, 2) == {1: 1, 2: 2}
