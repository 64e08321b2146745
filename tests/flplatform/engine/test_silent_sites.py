"""A connected site that answers nothing is named at once and no round waits for it.

Issue "Deploy 2": after a server stop, a SuperNode accepted the next run's messages and
never ran a ClientApp for them, and every round waited out its timeout. The engine's site
query (the run's first message to a site) now has a deadline of its own
(``query_timeout``; 60 s on a deployment): a site that leaves it unanswered is *silent* —
a warning and a ``site-silent`` event, no work, asked again while Flower holds no message
of it — until its SuperNode answers (``site-back``), and then it trains again.

The real ``RoundEngine`` and local-SGD strategy over a scripted grid, writing a real
SQLite ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message, MessageType

from flplatform.core.errors import RunFailed
from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry
from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import SITE_BACK_EVENT, SITE_SILENT_EVENT, presence_sentence
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid
from tests.helpers.scripted_sites import MODEL, expired, good, scripted

pytestmark = pytest.mark.usefixtures("task_identity")

QUERY_TIMEOUT = 0.2  # s: the scripted sites answer at once, or never


def silent_until(answers: Callable[[], bool], behaviour: Behaviour) -> Behaviour:
    """A site whose SuperNode answers nothing until ``answers()``, then as ``behaviour``."""
    return lambda msg: behaviour(msg) if answers() else None


def engine_over(
    grid: ScriptedGrid, repository: LedgerRepository, rounds: int, **options: float
) -> tuple[RoundEngine, int]:
    """The engine over ``grid`` (every site required) and its run in ``repository``."""
    run_id = repository.create_run(
        name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=rounds
    )
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        ledger=SqlLedger(repository, run_id),
        required_sites=len(grid.behaviours),
        query_timeout=QUERY_TIMEOUT,
        poll_interval=0.0,
        **options,  # type: ignore[arg-type]
    )
    return engine, run_id


def run(
    ledger: str, grid: ScriptedGrid, rounds: int
) -> tuple[list[int], dict[int, list[str]], list[tuple[str, dict[str, Any]]]]:
    """The engine over ``grid``: each round's applied count, who trained, the events."""
    return run_with(ledger, grid, rounds)


def run_with(
    ledger: str, grid: ScriptedGrid, rounds: int, **options: float
) -> tuple[list[int], dict[int, list[str]], list[tuple[str, dict[str, Any]]]]:
    """``run`` with the engine's ``options``."""
    with LedgerRepository.open(ledger) as repository:
        engine, run_id = engine_over(grid, repository, rounds, **options)
        engine.run(MODEL, num_rounds=rounds)
        rounds_ = repository.list_rounds(run_id)
        updates = repository.list_updates(run_id)
        events = [(e.kind, e.detail) for e in repository.list_events(run_id)]
    trained = {
        r.round: sorted(u.site for u in updates if u.round == r.round and u.status == "applied")
        for r in rounds_
    }
    return [r.num_applied for r in rounds_], trained, events


def sent_to(grid: ScriptedGrid, node_id: int, kind: str) -> int:
    return sum(
        1
        for m in grid.pushed
        if m.metadata.dst_node_id == node_id and m.metadata.message_type == kind
    )


def test_a_site_that_answers_nothing_is_named_at_once_and_given_no_work(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    sites = {
        1: scripted("london", good),
        2: silent_until(lambda: False, scripted("ohio", good)),
        3: scripted("tokyo", good),
    }
    grid = ScriptedGrid(sites)
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        applied, trained, events = run(sqlite_ledger, grid, 3)

    assert applied == [2, 2, 2]
    assert all(names == ["london", "tokyo"] for names in trained.values())
    # never asked to train, so no round could wait for it; its one query is still out
    assert sent_to(grid, 2, MessageType.TRAIN) == 0
    assert sent_to(grid, 2, MessageType.QUERY) == 1
    detail = {"site": "node-2", "round": None, "connected": 2, "sites": 3, "waited": QUERY_TIMEOUT}
    assert events == [(SITE_SILENT_EVENT, detail)]
    said = presence_sentence(SITE_SILENT_EVENT, detail)
    assert said.startswith("at start-up: site node-2 is silent: its SuperNode is connected")
    assert "no work until it answers (2 of 3 sites connected)" in said
    assert said in caplog.text


def test_a_silent_site_that_answers_at_last_trains_again(sqlite_ledger: str) -> None:
    trained_by_london = 0

    def london(msg: Message) -> Message | None:
        nonlocal trained_by_london
        if msg.metadata.message_type == MessageType.TRAIN:
            trained_by_london += 1
        return scripted("london", good)(msg)

    # ohio's SuperNode runs its ClientApp again once london has trained twice: its
    # pending query is answered, then it trains like the others
    ohio = silent_until(lambda: trained_by_london >= 2, scripted("ohio", good))
    grid = ScriptedGrid({1: london, 2: ohio, 3: scripted("tokyo", good)})
    applied, trained, events = run(sqlite_ledger, grid, 5)

    assert [kind for kind, _ in events] == [SITE_SILENT_EVENT, SITE_BACK_EVENT]
    back = events[1][1]
    # named as it was when it fell silent (no registry here: by its node id; on a
    # deployment, by its registered name): a late answer renames no site
    assert back["site"] == "node-2" and back["connected"] == 3 and back["round"] in (2, 3)
    assert applied[:2] == [2, 2] and applied[-1] == 3
    assert "node-2" not in trained[1] + trained[2]
    assert trained[5] == ["london", "node-2", "tokyo"]
    assert sent_to(grid, 2, MessageType.QUERY) == 1  # answered the query it held


def test_a_silent_sites_expired_query_is_asked_again_not_turned_into_work(
    sqlite_ledger: str,
) -> None:
    # Flower expires ohio's queries (its SuperNode never answers them): each time the
    # engine asks again, and never sends it training work meanwhile
    ohio: Behaviour = lambda msg: expired(msg)  # noqa: E731
    grid = ScriptedGrid(
        {1: scripted("london", good), 2: ohio, 3: scripted("tokyo", good)}, delay_pulls=1
    )
    applied, trained, events = run(sqlite_ledger, grid, 4)

    assert applied == [2, 2, 2, 2]
    assert sent_to(grid, 2, MessageType.TRAIN) == 0
    assert sent_to(grid, 2, MessageType.QUERY) >= 3  # asked again each round or so
    assert [kind for kind, _ in events] == [SITE_SILENT_EVENT]  # said once, not every time


@pytest.mark.parametrize("expires", [False, True], ids=["held", "expired"])
def test_with_every_site_silent_the_round_fails_instead_of_waiting_for_ever(
    sqlite_ledger: str, expires: bool
) -> None:
    # No SuperNode answers: Flower holds the queries (its TTL is long), or expires them
    # and the sites are asked again and again; no work can come of either, so the round
    # gives up after its timeout
    silent: Behaviour = (lambda msg: expired(msg)) if expires else (lambda msg: None)
    grid = ScriptedGrid({1: silent, 2: silent}, delay_pulls=1)
    with LedgerRepository.open(sqlite_ledger) as repository:
        engine, _ = engine_over(grid, repository, 2, round_timeout=1.0)
        with pytest.raises(RunFailed, match="round 1: no site could be given work within 1 s"):
            engine.run(MODEL, num_rounds=2)
    if not expires:  # given up while Flower still held the queries, not after it let go
        assert sorted(d.node_id for d in engine.mailbox.given_up.values()) == [1, 2]


class SuperLinkGrid(ScriptedGrid):
    """As Flower's SuperLink: a node whose reply waits to be pulled may get a new message
    (a silent site's query is asked again while the first is still held)."""

    def __init__(self, behaviours: dict[int, Behaviour]) -> None:
        super().__init__(behaviours)
        self._busy = _NeverBusy()


class _NeverBusy(dict):
    def __contains__(self, key: object) -> bool:
        return False


def test_a_silent_site_among_more_sites_than_a_pull_takes_is_heard_when_it_answers(
    sqlite_ledger: str,
) -> None:
    """Async mode with more messages out than one pull takes: the first chunk made the step
    ready every round, so the replies given up on (the silent site's query), queued behind
    the awaited ones, were never pulled, and the site never came back."""
    from flplatform.engine import Synchrony
    from flplatform.engine.mailbox import PULL_CHUNK

    count = PULL_CHUNK + 4
    holder: dict[str, RoundEngine] = {}

    answering: list[bool] = []  # once its query was given up on, its ClientApp runs

    def answers() -> bool:
        engine = holder.get("engine")
        if (
            not answering
            and engine is not None
            and any(d.node_id == count for d in engine.mailbox.given_up.values())
        ):
            answering.append(True)
        return bool(answering)

    sites = {n: scripted(f"site-{n}", good) for n in range(1, count)}
    sites[count] = silent_until(answers, scripted(f"site-{count}", good))
    grid = SuperLinkGrid(sites)
    with LedgerRepository.open(sqlite_ledger) as repository:
        engine, run_id = engine_over(grid, repository, 150, policy=Synchrony("async"))
        holder["engine"] = engine
        engine.run(MODEL, num_rounds=150)
        events = [(e.kind, e.detail) for e in repository.list_events(run_id)]
        updates = repository.list_updates(run_id)
    assert [kind for kind, _ in events] == [SITE_SILENT_EVENT, SITE_BACK_EVENT]
    assert any(u.site == f"node-{count}" and u.status == "applied" for u in updates)


def test_replies_that_came_in_time_are_not_dropped_behind_many_others(sqlite_ledger: str) -> None:
    """Sixty sites in async mode that answer at once, rounds of 10 ms of server work, a
    round timeout of 0.3 s: replies beyond the first chunks waited about a round each to
    be pulled, and were dropped as "no reply within" although they were there."""
    import time

    from flplatform.engine import Synchrony

    sites = {n: scripted(f"site-{n}", good) for n in range(1, 61)}
    grid = SuperLinkGrid(sites)
    with LedgerRepository.open(sqlite_ledger) as repository:
        engine, run_id = engine_over(
            grid,
            repository,
            120,
            policy=Synchrony("async"),
            round_timeout=0.3,
            on_round=lambda summary: time.sleep(0.01),
        )
        engine.run(MODEL, num_rounds=120)
        statuses = {u.status for u in repository.list_updates(run_id)}
    assert statuses == {"applied"}


# ---- a deployment's start-up: registered sites that stay silent are waited for
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **nodes: int) -> None:
    """A deployment's registry (``flplatform server`` writes it): site name → node id."""
    path = tmp_path / "registry.json"
    SiteRegistry(
        tuple(RegisteredSite(name, node, f"SHA256:{name}") for name, node in nodes.items())
    ).write(path)
    monkeypatch.setenv(REGISTRY_ENV, str(path))


def after(seconds: float) -> Callable[[], bool]:
    """True from ``seconds`` after the first call on (its first call: the site query)."""
    since: list[float] = []

    def passed() -> bool:
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= seconds

    return passed


@pytest.mark.parametrize("held", [True, False], ids=["query-held", "query-expired"])
def test_a_registered_site_silent_at_start_up_is_waited_for_and_trains_every_round(
    sqlite_ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """Issue 35: after a site's crash, the SuperLink counts its dead SuperNode a while,
    and the new run's query to it goes unanswered until the SuperNode started again
    joins. The run started without it (it trained from a later round, or in none of a
    short run); it now starts once the site answers: the restarted SuperNode takes the
    query Flower still holds (``held``), or the site is asked again after Flower expired
    the query (``expired``)."""
    registered(tmp_path, monkeypatch, london=1, ohio=2)
    back = after(4 * QUERY_TIMEOUT)  # past the query's deadline: silent first
    restarting: Behaviour = scripted("ohio", good)
    ohio = (
        silent_until(back, restarting)
        if held
        else (lambda msg: restarting(msg) if back() else expired(msg))
    )
    grid = ScriptedGrid({1: scripted("london", good), 2: ohio}, delay_pulls=0 if held else 1)
    with LedgerRepository.open(sqlite_ledger) as repository:
        engine, run_id = engine_over(grid, repository, 2, startup_timeout=30.0)
        engine.run(MODEL, num_rounds=2)
        rounds = repository.list_rounds(run_id)
        updates = repository.list_updates(run_id)
        events = [(e.kind, e.detail) for e in repository.list_events(run_id)]
    assert [r.num_applied for r in rounds] == [2, 2]
    assert {(u.round, u.site) for u in updates if u.status == "applied"} == {
        (r, s) for r in (1, 2) for s in ("london", "ohio")
    }
    # said silent at its query's deadline, and back before the first round
    assert [(kind, d["site"], d["round"]) for kind, d in events] == [
        (SITE_SILENT_EVENT, "ohio", None),
        (SITE_BACK_EVENT, "ohio", None),
    ]
    queries = sent_to(grid, 2, MessageType.QUERY)
    assert queries == 1 if held else queries >= 2  # expired: asked again


def test_a_registered_site_that_never_answers_is_waited_for_until_the_start_up_timeout(
    sqlite_ledger: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SuperNode that takes the run's messages and runs no ClientApp: the start waits
    for it as long as for a site to connect, then the run goes on without it, and no
    round waits for it."""
    registered(tmp_path, monkeypatch, london=1, ohio=2)
    grid = ScriptedGrid({1: scripted("london", good), 2: lambda msg: None})
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flplatform.engine"):
        applied, trained, events = run_with(sqlite_ledger, grid, 2, startup_timeout=1.5)
    took = time.monotonic() - started
    assert took >= 1.5
    assert applied == [1, 1] and trained == {1: ["london"], 2: ["london"]}
    [(kind, detail)] = events
    assert (kind, detail["site"], detail["waited"]) == (SITE_SILENT_EVENT, "ohio", QUERY_TIMEOUT)
    assert 1 <= detail["start_wait"] <= 2  # what was left of the 1.5 s, in whole seconds
    said = presence_sentence(kind, detail)
    assert f"the first round waits for it up to {detail['start_wait']:g} s more" in said
    assert said in caplog.text
    assert "starting without ohio: silent since the start-up" in caplog.text
    assert sent_to(grid, 2, MessageType.TRAIN) == 0


def test_a_silent_site_without_a_registered_name_is_not_waited_for(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # named by its node id, it cannot be told from a dead node Flower still lists
    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    grid = ScriptedGrid({1: scripted("london", good), 2: lambda msg: None})
    started = time.monotonic()
    applied, _, _ = run_with(sqlite_ledger, grid, 1, startup_timeout=30.0)
    assert applied == [1]
    assert time.monotonic() - started < 15.0  # not the start-up timeout
