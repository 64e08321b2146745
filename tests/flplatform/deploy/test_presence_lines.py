"""`flplatform server` says at once when a run loses a site or gets it back: each of the
engine's site-lost and site-back events of the run, read from a real SQLite ledger, once;
and, with --insecure, the names the sites gave themselves."""

from __future__ import annotations

import pytest

from flplatform.deploy import superlink
from flplatform.deploy.superlink import PresenceLines
from flplatform.engine.events import SITE_BACK_EVENT, SITE_LOST_EVENT
from flplatform.run.run_record import DEPLOYED_EVENT
from storage import LedgerRepository


def test_each_site_lost_or_back_is_said_once_and_other_events_not_at_all(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(superlink, "PRESENCE_EVERY", 0.0)
    said: list[str] = []
    lines = PresenceLines(said.append)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        repository.add_event(run_id, DEPLOYED_EVENT, {"sites": ["london", "ohio"]})
        lost = {"site": "ohio", "round": 3, "connected": 1, "sites": 2}
        repository.add_event(run_id, SITE_LOST_EVENT, lost)
        lines.poll(run_id, sqlite_ledger)
        lines.poll(run_id, sqlite_ledger)
        back = {"site": "ohio", "round": 5, "connected": 2, "sites": 2}
        repository.add_event(run_id, SITE_BACK_EVENT, back)
        lines.poll(run_id, sqlite_ledger)
    assert said == [
        "round 3: site ohio left: the SuperLink no longer lists its SuperNode, and it gets "
        "no work until it is back (1 of 2 sites connected)",
        "round 5: site ohio is back (2 of 2 sites connected)",
    ]


def test_events_are_read_at_most_every_few_seconds(sqlite_ledger: str) -> None:
    said: list[str] = []
    lines = PresenceLines(said.append)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        lines.poll(run_id, sqlite_ledger)  # read: nothing yet
        lost = {"site": "ohio", "round": 2, "connected": 1, "sites": 2}
        repository.add_event(run_id, SITE_LOST_EVENT, lost)
        lines.poll(run_id, sqlite_ledger)  # within PRESENCE_EVERY of the last read
    assert said == []
    lines.next_read = 0.0  # the interval has passed
    lines.poll(run_id, sqlite_ledger)
    assert len(said) == 1 and "site ohio left" in said[0]


def test_the_last_events_of_a_run_are_said_whenever_it_ended(sqlite_ledger: str) -> None:
    said: list[str] = []
    lines = PresenceLines(said.append)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        lines.poll(run_id, sqlite_ledger)
        lost = {"site": "ohio", "round": 5, "connected": 1, "sites": 2}
        repository.add_event(run_id, SITE_LOST_EVENT, lost)
    lines.poll(run_id, sqlite_ledger, final=True)  # the run ended within PRESENCE_EVERY
    assert len(said) == 1 and "site ohio left" in said[0]


# ------------------------------------------------------------------- --insecure names
def _run_with_sites(db: str, *names: str) -> int:
    """A run whose sites named themselves ``names`` (node ids 11, 12, ...)."""
    with LedgerRepository.open(db) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        for node, name in enumerate(names, start=11):
            repository.add_site(run_id, name=name, node_id=node)
    return run_id


def test_insecure_sites_are_named_as_they_named_themselves_and_strangers_warned_of(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(superlink, "PRESENCE_EVERY", 0.0)
    said: list[str] = []
    lines = PresenceLines(said.append, unauthenticated=("london", "ohio"))
    run_id = _run_with_sites(sqlite_ledger, "london")
    lines.poll(run_id, sqlite_ledger)  # one of two: not yet
    assert said == []
    with LedgerRepository.open(sqlite_ledger) as repository:
        repository.add_site(run_id, name="mallory", node_id=12)
    lines.poll(run_id, sqlite_ledger)
    lines.poll(run_id, sqlite_ledger)  # said once
    assert said == [
        "the sites named themselves (unauthenticated, --insecure): london (node 11), "
        "mallory (node 12)",
        "warning: mallory not among --sites london,ohio: without --certs any node may join "
        "under any name",
    ]


def test_insecure_names_are_said_when_the_run_ends_short_of_sites(sqlite_ledger: str) -> None:
    said: list[str] = []
    lines = PresenceLines(said.append, unauthenticated=("london", "ohio"))
    lines.poll(_run_with_sites(sqlite_ledger, "london"), sqlite_ledger, final=True)
    assert said == ["the sites named themselves (unauthenticated, --insecure): london (node 11)"]


def test_registered_sites_are_not_named_again(sqlite_ledger: str) -> None:
    said: list[str] = []
    lines = PresenceLines(said.append)  # a deployment with --certs: their keys named them
    lines.poll(_run_with_sites(sqlite_ledger, "london", "ohio"), sqlite_ledger, final=True)
    assert said == []
