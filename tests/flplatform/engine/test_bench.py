"""A site whose training fails sits out a doubling number of rounds, and no round waits
for it; an applied update ends its streak. The real engine, strategy and SQL ledger; only
the transport is in-process (a site's process that dies answers with its error, as
Flower's simulation does)."""

from __future__ import annotations

import pytest

from flplatform.core.checkpoint import CheckpointError
from flplatform.engine import APPLIED, DROPPED
from flplatform.engine.bench import MAX_ROUNDS, SiteBench
from storage import LedgerRepository
from tests.helpers.scripted_sites import crashes, good, latest_run, run, scripted

pytestmark = pytest.mark.usefixtures("task_identity")

DIED = "worker process has died"


def rounds_offered(repository: LedgerRepository, site: str) -> dict[int, str]:
    """round → status of every update of ``site``."""
    updates = repository.list_updates(latest_run(repository))
    return {u.round: u.status for u in updates if u.site == site}


def test_a_site_that_dies_every_round_sits_out_one_two_four_rounds(
    repository: LedgerRepository,
) -> None:
    sites = {1: scripted("a", good), 2: scripted("b", good), 3: scripted("c", crashes(DIED))}
    run(repository, sites, rounds=12)
    # failed in 1 (out 2), 3 (out 4-5), 6 (out 7-10), 11 (out 12-19)
    assert rounds_offered(repository, "c") == {r: DROPPED for r in (1, 3, 6, 11)}
    assert rounds_offered(repository, "a") == {r: APPLIED for r in range(1, 13)}
    updates = repository.list_updates(latest_run(repository))
    said = [u.reason for u in updates if u.site == "c"]
    assert said == [
        f"site error 0: {DIED}; benched for the next {n} round{'s' * (n > 1)}" for n in (1, 2, 4, 8)
    ]
    # every round went on without it: two applied updates each
    rounds = repository.list_rounds(latest_run(repository))
    assert [r.num_applied for r in rounds] == [2] * 12


def test_a_site_that_recovers_is_offered_every_round_again(repository: LedgerRepository) -> None:
    recovers = scripted("c", crashes(DIED), crashes(DIED), good)
    run(repository, {1: scripted("a", good), 2: recovers}, rounds=8)
    assert rounds_offered(repository, "c") == {
        1: DROPPED,
        3: DROPPED,
        **{r: APPLIED for r in (6, 7, 8)},
    }


def test_no_site_is_benched_in_a_round_that_applied_nothing(
    repository: LedgerRepository,
) -> None:
    """Every site failing is the stop rule's to judge: all are offered the next rounds."""
    sites = {1: scripted("a", crashes(DIED)), 2: scripted("b", crashes(DIED))}
    run(repository, sites, rounds=2)
    assert rounds_offered(repository, "a") == {1: DROPPED, 2: DROPPED}
    assert rounds_offered(repository, "b") == {1: DROPPED, 2: DROPPED}


def test_the_bench_never_leaves_no_site_and_caps_at_max_rounds() -> None:
    bench = SiteBench()
    assert bench.failed("a", 1, others=["a", "b"]) == 1
    assert bench.failed("b", 1, others=["a", "b"]) == 0  # a sits out round 2 already
    assert not bench.benched("b", 2) and bench.benched("a", 2) and not bench.benched("a", 3)
    for n in range(2, 10):
        bench.failed("a", 10 * n, others=["a", "b"])
    assert bench.failed("a", 100, others=["a", "b"]) == MAX_ROUNDS
    bench.succeeded("a")
    assert not bench.benched("a", 101) and bench.failed("a", 101, others=["a", "b"]) == 1


def test_the_bench_is_restored_by_site_name_and_refuses_a_bad_state() -> None:
    bench = SiteBench()
    bench.failed("c", 5, others=["a", "c"])
    bench.failed("c", 7, others=["a", "c"])
    restored = SiteBench()
    restored.load_state_dict(bench.state_dict())
    assert restored.state_dict() == {"failures": {"c": 2}, "until": {"c": 10}}
    assert restored.benched("c", 9) and not restored.benched("c", 10)
    restored.load_state_dict(None)  # a checkpoint from before benching
    assert restored.state_dict() == {"failures": {}, "until": {}}
    with pytest.raises(CheckpointError, match="'until' must map site names to counts"):
        restored.load_state_dict({"failures": {}, "until": {"c": -1}})


def test_a_strategy_that_needs_the_benched_site_gets_it_and_the_run_goes_on(
    repository: LedgerRepository,
) -> None:
    """Flower's FedAvg waits for 2 sites: with one of two benched nothing could be sent,
    so that round offers the benched site work after all, instead of failing the run."""
    from flwr.serverapp.strategy import FedAvg

    from flplatform.engine.engine import RoundEngine
    from flplatform.run.flower_adapter import FlowerStrategyAdapter
    from flplatform.run.ledger import SqlLedger
    from tests.helpers.scripted_grid import ScriptedGrid
    from tests.helpers.scripted_sites import MODEL

    run_id = repository.create_run(
        name="t", strategy="fedavg", seed=0, config={}, num_rounds_planned=3
    )
    sites = {1: scripted("a", good), 2: scripted("b", crashes(DIED), good)}
    RoundEngine(
        ScriptedGrid(sites),
        FlowerStrategyAdapter(FedAvg()),
        ledger=SqlLedger(repository, run_id),
        required_sites=2,
        poll_interval=0.0,
        round_timeout=5.0,
    ).run(MODEL, num_rounds=3)
    updates = repository.list_updates(run_id)
    assert [(u.round, u.site, u.status) for u in updates if u.site == "b"] == [
        (1, "b", DROPPED),
        (2, "b", APPLIED),  # benched, but FedAvg needs both sites: offered after all
        (3, "b", APPLIED),
    ]
    assert len(repository.list_rounds(run_id)) == 3
