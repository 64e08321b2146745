"""The engine's stop rule: rounds in a row that applied nothing although replies came back
end the run, whatever the reasons.

The real ``RoundEngine`` and local-SGD strategy over a scripted grid, writing a real SQLite
ledger, so the tests also see that the round that trips the rule is recorded.
"""

from __future__ import annotations

import contextlib

import pytest
from flwr.app import (
    ArrayRecord,
    MetricRecord,
)

from flplatform.core.errors import ConfigError, NoProgress, RunFailed
from flplatform.engine import DROPPED, REJECTED
from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import UpdateOutcome
from flplatform.engine.stop_rule import FailureStreak, reason_key
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.idle_sites import CountingStrategy, idle_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.scripted_sites import (
    WRONG_KEYS,
    crashes,
    good,
    latest_run,
    run,
    scripted,
    through_the_mod,
    wrong_keys,
)

pytestmark = pytest.mark.usefixtures("task_identity")


def test_three_rounds_rejected_alike_stop_the_run_after_recording_the_third(
    repository: LedgerRepository,
) -> None:
    sites = {1: scripted("a", wrong_keys), 2: scripted("b", wrong_keys)}
    with pytest.raises(NoProgress) as stopped:
        run(repository, sites, rounds=10)
    assert stopped.value.reason.startswith(
        f"rounds 1-3 applied no update: every reply was rejected: {WRONG_KEYS} "
    )
    assert "max-failed-rounds" in stopped.value.reason
    # A RunFailed, so run_federation marks the run failed with this reason.
    assert isinstance(stopped.value, RunFailed) and stopped.value.exit_code == RunFailed.exit_code
    rounds = repository.list_rounds(latest_run(repository))
    assert [(r.round, r.num_applied, r.num_rejected) for r in rounds] == [
        (1, 0, 2),
        (2, 0, 2),
        (3, 0, 2),
    ]
    updates = repository.list_updates(latest_run(repository), round=3)
    assert {(u.status, u.reason) for u in updates} == {(REJECTED, WRONG_KEYS)}


def test_reasons_differing_only_in_numbers_are_the_same_failure(
    repository: LedgerRepository,
) -> None:
    sites = {
        1: scripted("a", crashes("RuntimeError: size mismatch for fc.weight: shape (10, 64)")),
        2: scripted("b", crashes("RuntimeError: size mismatch for fc.weight: shape (10, 32)")),
    }
    with pytest.raises(NoProgress, match=r"^rounds 1-2 applied no update: every reply was "):
        run(repository, sites, rounds=5, max_failed_rounds=2)
    reason = repository.list_updates(latest_run(repository), site="b")[-1].reason
    assert reason == "site error 0: RuntimeError: size mismatch for fc.weight: shape (10, 32)"
    assert [r.num_dropped for r in repository.list_rounds(latest_run(repository))] == [2, 2]


def test_mixed_reasons_in_a_round_stop_the_run_naming_each(
    repository: LedgerRepository,
) -> None:
    sites = {1: scripted("a", wrong_keys), 2: scripted("b", crashes("ValueError: out of memory"))}
    with pytest.raises(NoProgress) as stopped:
        run(repository, sites, rounds=5)
    rounds = repository.list_rounds(latest_run(repository))
    assert [(r.num_applied, r.num_rejected, r.num_dropped) for r in rounds] == [(0, 1, 1)] * 3
    assert stopped.value.reason.startswith(
        "rounds 1-3 applied no update: every reply was dropped or rejected: "
    )
    assert WRONG_KEYS in stopped.value.reason
    assert "site error 0: ValueError: out of memory" in stopped.value.reason


def test_reasons_that_alternate_from_round_to_round_still_stop_the_run(
    repository: LedgerRepository,
) -> None:
    # The user's app whose failure is reported one way, then another: no round applies
    # anything, so the rule trips as if they had failed alike.
    crash = crashes("ValueError: out of memory")
    sites = {n: scripted(name, wrong_keys, crash, wrong_keys) for n, name in ((1, "a"), (2, "b"))}
    with pytest.raises(NoProgress) as stopped:
        run(repository, sites, rounds=9)
    rounds = repository.list_rounds(latest_run(repository))
    assert [(r.num_rejected, r.num_dropped) for r in rounds] == [(2, 0), (0, 2), (2, 0)]
    # The latest reason first, each named once.
    assert stopped.value.reason.startswith(
        f"rounds 1-3 applied no update: every reply was dropped or rejected: {WRONG_KEYS}; "
        "site error 0: ValueError: out of memory "
    )


def test_one_applied_update_ends_the_streak(repository: LedgerRepository) -> None:
    # b fails like a, except in round 2, where its update is applied.
    sites = {1: scripted("a", wrong_keys), 2: scripted("b", wrong_keys, good, wrong_keys)}
    run_id = run(repository, sites, rounds=4)
    assert [r.num_applied for r in repository.list_rounds(run_id)] == [0, 1, 0, 0]
    # The streak restarts after round 2: rounds 3-5 are the next three.
    sites = {1: scripted("a", wrong_keys), 2: scripted("b", wrong_keys, good, wrong_keys)}
    with pytest.raises(NoProgress, match="^rounds 3-5 applied no update"):
        run(repository, sites, rounds=8)
    assert len(repository.list_rounds(latest_run(repository))) == 5


def test_at_most_three_reasons_are_named_the_latest_first() -> None:
    streak = FailureStreak(5)
    for server_round, reason in enumerate(["one", "two", "three", "four", "two"], start=1):
        with contextlib.suppress(NoProgress):
            streak.observe(server_round, applied=0, failed_replies=[outcome(REJECTED, reason)])
    assert streak.state_dict()["reasons"] == ["three", "four", "two"]
    restored = FailureStreak(6)
    restored.load_state_dict(streak.state_dict())
    with pytest.raises(NoProgress) as stopped:
        restored.observe(6, applied=0, failed_replies=[outcome(DROPPED, "five")])
    assert stopped.value.reason.startswith(
        "rounds 1-6 applied no update: every reply was dropped or rejected: five; two; four "
    )


def test_an_update_the_sites_mod_refused_is_rejected_with_its_sentence(
    repository: LedgerRepository,
) -> None:
    sites = {1: scripted("a", through_the_mod), 2: scripted("b", through_the_mod)}
    with pytest.raises(NoProgress) as stopped:
        run(repository, sites, rounds=5)
    said = "refused at the site: your train function's metrics: num-examples must be a positive"
    assert stopped.value.reason.startswith(
        f"rounds 1-2 applied no update: every reply was rejected: {said}"
    )
    assert stopped.value.reason.endswith(
        "(stopped after 2 rounds in a row: the sites' mods refused what the app's train "
        "function returned; fix the app or its settings; max-failed-rounds 0 never stops)"
    )
    updates = repository.list_updates(latest_run(repository))
    assert {u.status for u in updates} == {REJECTED}
    assert all((u.reason or "").startswith(said) for u in updates)


def test_site_refusals_stop_sooner_only_while_they_are_all_the_streak_has() -> None:
    refused = [outcome(REJECTED, "refused at the site: no num-examples")]
    # A round the strategy rejected in the streak: the usual limit.
    streak = FailureStreak(3)
    streak.observe(1, applied=0, failed_replies=[outcome(REJECTED, WRONG_KEYS)])
    streak.observe(2, applied=0, failed_replies=refused)
    with pytest.raises(NoProgress, match=r"^rounds 1-3 .*\(stopped after 3 such rounds"):
        streak.observe(3, applied=0, failed_replies=refused)
    # A site's crash beside a refusal in the same round: the usual limit too.
    streak = FailureStreak(3)
    crashed = outcome(DROPPED, "site error 2: ClientAppException")
    streak.observe(1, applied=0, failed_replies=[*refused, crashed])
    streak.observe(2, applied=0, failed_replies=refused)
    assert streak.rounds == [1, 2]
    # Refusals alone trip at 2, a lower limit stays lower, 0 never stops; a restored
    # streak keeps counting so.
    streak = FailureStreak(3)
    streak.observe(1, applied=0, failed_replies=refused)
    restored = FailureStreak(3)
    restored.load_state_dict(streak.state_dict())
    with pytest.raises(NoProgress, match=r"^rounds 1-2 .*\(stopped after 2 rounds in a row"):
        restored.observe(2, applied=0, failed_replies=refused)
    with pytest.raises(NoProgress, match=r"^round 1 .*\(stopped after 1 such rounds"):
        FailureStreak(1).observe(1, applied=0, failed_replies=refused)
    # restored without a streak (the usual checkpoint), the next streak is judged afresh
    restored = FailureStreak(3)
    restored.load_state_dict(FailureStreak(3).state_dict())
    restored.observe(1, applied=0, failed_replies=refused)
    with pytest.raises(NoProgress, match=r"\(stopped after 2 rounds in a row"):
        restored.observe(2, applied=0, failed_replies=refused)
    never = FailureStreak(0)
    for server_round in range(1, 5):
        never.observe(server_round, applied=0, failed_replies=refused)
    assert never.rounds == [1, 2, 3, 4]


def test_zero_never_stops(repository: LedgerRepository) -> None:
    sites = {1: scripted("a", wrong_keys), 2: scripted("b", wrong_keys)}
    run_id = run(repository, sites, rounds=6, max_failed_rounds=0)
    assert [r.num_rejected for r in repository.list_rounds(run_id)] == [2] * 6


def test_rounds_that_accept_updates_without_a_new_model_never_stop() -> None:
    """Like Sketched-SGD's sketch round: every update is accepted, the model does not move."""

    class NoStep(CountingStrategy):
        def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
            return None, None

    strategy = NoStep()
    grid = ScriptedGrid({1: idle_site("a"), 2: idle_site("b")})
    engine = RoundEngine(grid, strategy, required_sites=2, poll_interval=0.0, max_failed_rounds=1)
    engine.run(ArrayRecord(), num_rounds=4)
    assert engine.version == 0 and len(strategy.applied) == 8


@pytest.mark.parametrize("limit", [-1, 1.5, True])
def test_a_bad_limit_is_a_config_error(limit: object) -> None:
    with pytest.raises(ConfigError, match="max-failed-rounds must be an integer >= 0"):
        RoundEngine(ScriptedGrid({}), LocalSGDAveraging(), max_failed_rounds=limit)  # type: ignore[arg-type]


def outcome(status: str, reason: str | None) -> UpdateOutcome:
    return UpdateOutcome(
        site="a",
        dispatched_round=1,
        version_trained_on=0,
        staleness=0,
        bytes_up=0,
        bytes_down=0,
        status=status,
        dispatched_at=0.0,
        reason=reason,
    )


def test_rounds_without_failed_replies_end_the_streak() -> None:
    """Rounds where no reply came back (only timeouts, or a pipelined round in which nothing
    landed) neither count nor keep a streak going."""
    streak = FailureStreak(2)
    rejected = [outcome(REJECTED, WRONG_KEYS)]
    streak.observe(1, applied=0, failed_replies=rejected)
    streak.observe(2, applied=0, failed_replies=[])
    assert streak.rounds == []
    streak.observe(3, applied=0, failed_replies=rejected)
    with pytest.raises(NoProgress, match="^rounds 3-4 applied no update: every reply was rejected"):
        streak.observe(4, applied=0, failed_replies=rejected)


def test_one_round_limit_and_mixed_statuses_are_named() -> None:
    streak = FailureStreak(1)
    same = [outcome(DROPPED, "late by 3 s"), outcome(REJECTED, "late by 12 s")]
    with pytest.raises(NoProgress) as stopped:
        streak.observe(7, applied=0, failed_replies=same)
    assert stopped.value.reason.startswith(
        "round 7 applied no update: every reply was dropped or rejected: late by 12 s "
    )


def test_reason_key_ignores_numbers_and_spacing_only() -> None:
    assert reason_key("shape (10,  64) at 0x7f3a9c") == reason_key("shape (10, 32) at 0xdeadbeef")
    assert reason_key("missing arrays: w") != reason_key("unexpected arrays: w")


def test_a_streak_saved_before_its_reasons_were_kept_resumes_without_them() -> None:
    streak = FailureStreak(2)
    streak.load_state_dict({"rounds": [4], "key": "missing arrays: #", "statuses": ["rejected"]})
    with pytest.raises(NoProgress, match="^rounds 4-5 applied no update: every reply was "):
        streak.observe(5, applied=0, failed_replies=[outcome(REJECTED, WRONG_KEYS)])
