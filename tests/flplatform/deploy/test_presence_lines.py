"""`flplatform server` says at once when a run loses a site or gets it back: each of the
engine's site-lost and site-back events of the run, read from a real SQLite ledger, once;
and, with --insecure, the names the sites gave themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flplatform.deploy import superlink
from flplatform.deploy.certs import init_certs, make_site_key
from flplatform.deploy.superlink import InsecureNames, PresenceLines
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
def _insecure_plan() -> superlink.ServerPlan:
    return superlink.plan_server(
        sites=["london", "ohio"], certs_dir=None, address="127.0.0.1:9", wait_timeout=1,
        insecure=True,
    )  # fmt: skip


def test_insecure_sites_are_named_as_they_named_themselves_and_strangers_warned_of(
    sqlite_ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(superlink, "PRESENCE_EVERY", 0.0)
    said: list[str] = []
    names = InsecureNames(_insecure_plan(), said.append)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        repository.add_site(run_id, name="london", node_id=11)
        names.poll(run_id, sqlite_ledger)  # one of two: not yet
        assert said == []
        repository.add_site(run_id, name="mallory", node_id=12)
        names.poll(run_id, sqlite_ledger)
        names.poll(run_id, sqlite_ledger)  # said once
    assert said == [
        "the sites named themselves (unauthenticated, --insecure): london (node 11), "
        "mallory (node 12)",
        "warning: mallory not among --sites london,ohio: without --certs any node may join "
        "under any name",
    ]


def test_insecure_names_are_said_when_the_run_ends_short_of_sites(sqlite_ledger: str) -> None:
    said: list[str] = []
    names = InsecureNames(_insecure_plan(), said.append)
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        repository.add_site(run_id, name="london", node_id=11)
    names.poll(run_id, sqlite_ledger, final=True)
    assert said == ["the sites named themselves (unauthenticated, --insecure): london (node 11)"]


def test_registered_sites_are_not_named_again(sqlite_ledger: str, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_certs(certs)
    for name in ("london", "ohio"):
        shutil.copy(make_site_key(name, tmp_path / name).public_key, certs)
    plan = superlink.plan_server(
        sites=["london", "ohio"], certs_dir=certs, address="127.0.0.1:9", wait_timeout=1,
        insecure=False,
    )  # fmt: skip
    said: list[str] = []
    with LedgerRepository.open(sqlite_ledger) as repository:
        run_id = repository.create_run(
            name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=5
        )
        repository.add_site(run_id, name="london", node_id=11)
        repository.add_site(run_id, name="ohio", node_id=12)
    InsecureNames(plan, said.append).poll(run_id, sqlite_ledger, final=True)
    assert said == []  # their keys named them (the registry), checked by the gateway
