"""Training that diverges is reported once, at the round it happens, with its likely fix.

The rule (``DivergenceWatch``) on hand-made losses, then the real ``RoundEngine`` over a
scripted grid writing a real SQLite ledger: the report is the round's warning and the
run's note, kept when the run finishes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.engine import RoundSummary
from flplatform.engine.divergence import FACTOR, Divergence, DivergenceWatch, ReportedLoss
from flplatform.engine.engine import RoundEngine
from flplatform.engine.guard import UpdateGuard
from flplatform.engine.replies import reported_losses
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid
from tests.helpers.scripted_sites import scripted


def said(site: str, train: float | None, first: float | None = None, n: int = 10) -> ReportedLoss:
    return ReportedLoss(site, n, train, first)


# ============================================================================= the rule
def test_a_round_beyond_ten_times_the_first_train_loss_diverges_once() -> None:
    watch = DivergenceWatch()
    # Round 1 sets the first value (no site reported a first-batch loss): 2.0.
    assert watch.observe(1, train_loss=2.0, reported=[said("a", 2.0)]) is None
    assert watch.first == 2.0
    # Exactly 10× is not beyond it; 10× and a bit is.
    assert watch.observe(2, train_loss=FACTOR * 2.0, reported=[said("a", 20.0)]) is None
    found = watch.observe(3, train_loss=20.5, reported=[said("a", 20.5)])
    assert found == Divergence(
        3, "train loss 20.5 is more than 10× the first loss 2 (round 1's train loss)"
    )
    # Reported once: worse rounds after it say nothing, non-finite ones neither.
    assert watch.observe(4, train_loss=1e9, reported=[said("a", 1e9)]) is None
    assert watch.observe(5, train_loss=math.nan, reported=[said("a", math.inf)]) is None


def test_the_first_batch_loss_catches_a_run_that_blows_up_within_round_one() -> None:
    # Raw wine: the received model scores 5.6 on its first batch, the round averages 1e5.
    # Example-weighted first value: (10·5 + 30·6) / 40 = 5.75.
    watch = DivergenceWatch()
    found = watch.observe(
        1, train_loss=1e5, reported=[said("a", 9e4, 5.0, n=10), said("b", 1.1e5, 6.0, n=30)]
    )
    assert found is not None and found.server_round == 1
    assert found.finding == (
        "train loss 1e+05 is more than 10× the first loss 5.75 "
        "(the sites' first-batch loss in round 1)"
    )
    # The same round judged by its own train loss would never trip.
    alone = DivergenceWatch()
    assert alone.observe(1, train_loss=1e5, reported=[said("a", 1e5)]) is None


def test_a_healthy_run_is_never_reported() -> None:
    watch = DivergenceWatch()
    for server_round, loss in enumerate([2.3, 1.9, 1.2, 0.8, 1.4, 0.5], start=1):
        assert watch.observe(server_round, train_loss=loss, reported=[said("a", loss, 2.4)]) is None


def test_a_site_reporting_a_non_finite_loss_is_divergence() -> None:
    # The ledger keeps only finite losses (the row says None); the watch reads the reply's.
    watch = DivergenceWatch()
    found = watch.observe(
        1,
        train_loss=0.7,  # the other sites' mean: the NaN one is not in it
        reported=[said("a", 0.7), said("b", math.nan), said("c", 0.7, -math.inf), said("d", None)],
    )
    assert found == Divergence(
        1, "non-finite values from b (train loss nan), c (first-batch loss -inf)"
    )


def test_a_reply_refused_for_nan_values_is_divergence() -> None:
    # A site whose model went NaN sends no loss at all: flplatform's mod refuses the model
    # at the site (an error reply), a strategy at the server.
    gone = "site error 0: UpdateRejected: your train function returned 'fc1.weight' with NaN or Inf"
    refused = [
        ReportedLoss("a", None, None, None, refused=gone),
        ReportedLoss("b", 10, 0.7, None, refused="array 'w' contains NaN or Inf"),
        ReportedLoss("c", None, None, None, refused="no reply within 15 s"),  # not a sign
        ReportedLoss("d", 10, 0.7, None, refused="information: infinitely late"),  # neither
    ]
    found = DivergenceWatch().observe(2, train_loss=0.7, reported=refused)
    assert found == Divergence(
        2, f"non-finite values from a (refused: {gone}), b (refused: array 'w' contains NaN or Inf)"
    )
    quiet = DivergenceWatch()
    assert quiet.observe(1, train_loss=0.7, reported=refused[2:]) is None


def test_a_refused_reply_sets_no_first_loss() -> None:
    """A hostile site's first-batch loss of 1e-9 over 10^12 claimed examples, its update
    rejected: counted, it made the first loss 1e-9, and every honest round "diverged"."""
    watch = DivergenceWatch()
    hostile = ReportedLoss("x", 10**12, 1e-9, 1e-9, refused="norm 1e+06 is 1e+06x the median")
    assert watch.observe(1, train_loss=2.0, reported=[said("a", 2.0, 2.4), hostile]) is None
    assert watch.first == 2.4
    assert watch.observe(2, train_loss=1.5, reported=[said("a", 1.5)]) is None


def test_a_non_finite_round_loss_is_divergence_without_any_first_value() -> None:
    found = DivergenceWatch().observe(1, train_loss=math.inf, reported=[])
    assert found == Divergence(1, "the round's train loss is inf")


def test_no_first_value_yet_or_one_at_zero_is_no_scale_to_compare_with() -> None:
    watch = DivergenceWatch()
    assert watch.observe(1, train_loss=None, reported=[]) is None  # nothing arrived
    assert watch.first is None
    assert watch.observe(2, train_loss=0.0, reported=[said("a", 0.0)]) is None
    assert watch.observe(3, train_loss=5.0, reported=[said("a", 5.0)]) is None  # 0 × 10


def test_the_likely_fix_names_the_sites_far_from_unit_scale() -> None:
    found = Divergence(1, "train loss 1e+05 is more than 10× the first loss 5.75 (...)")
    text = found.describe({"london": 810.2, "ohio": 1.0, "tokyo": 0.05, "paris": None})
    assert text.startswith("round 1: training diverged: train loss 1e+05")
    assert "site(s) london (810), tokyo (0.05) are far from unit scale" in text
    assert "ohio" not in text and "paris" not in text
    assert "standardize-features = true" in text and "--standardize-features" in text
    # Sites near unit scale, or sites that said nothing (a plain Flower ClientApp): no hint.
    plain = found.describe({"london": None, "ohio": 1.0})
    assert plain == "round 1: training diverged: " + found.finding


@pytest.mark.usefixtures("task_identity")
def test_reported_losses_keeps_what_the_ledger_row_drops() -> None:
    def reply(metrics: dict) -> Message:
        msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
        return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)

    assert reported_losses(reply({"num-examples": 3, "loss": math.nan})) == (
        pytest.approx(math.nan, nan_ok=True),
        None,
    )
    assert reported_losses(reply({"train_loss": 0.5, keys.FIRST_BATCH_LOSS: math.inf})) == (
        0.5,
        math.inf,
    )
    assert reported_losses(reply({"num-examples": 3})) == (None, None)


# ========================================================================= the engine
MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})


def site(name: str, losses: list[float], *, scale: float | None = None) -> Behaviour:
    """Introduces itself (with a feature scale, if given), then reports ``losses`` in turn."""
    sent = 0

    def behave(msg: Message) -> Message:
        nonlocal sent
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: name})
            if scale is not None:
                info[keys.FEATURE_SCALE] = scale
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        loss = losses[min(sent, len(losses) - 1)]
        sent += 1
        arrays = ArrayRecord({"w": Array(np.ones(4, np.float32))})
        metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: loss})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)

    return behave


def run(
    grid: ScriptedGrid,
    ledger: tuple[LedgerRepository, int],
    *,
    guard: UpdateGuard | None = None,
    strategy: LocalSGDAveraging | None = None,
) -> list[RoundSummary]:
    repo, run_id = ledger
    seen: list[RoundSummary] = []
    RoundEngine(
        grid,
        strategy or LocalSGDAveraging(),
        ledger=SqlLedger(repo, run_id),
        guard=guard,
        poll_interval=0.0,
        required_sites=len(grid.behaviours),
        on_round=seen.append,
    ).run(MODEL, num_rounds=4)
    return seen


@pytest.mark.usefixtures("task_identity")
def test_a_site_reporting_nan_is_reported_once_with_the_fix_and_kept_in_the_ledger(
    ledger: tuple[LedgerRepository, int],
) -> None:
    # london's raw features (scale 810) blow up from round 2; ohio's are fine.
    grid = ScriptedGrid(
        {1: site("london", [2.0, math.nan], scale=810.0), 2: site("ohio", [2.0], scale=0.9)}
    )
    seen = run(grid, ledger)
    assert [s.warning is not None for s in seen] == [False, True, False, False]
    warning = seen[1].warning or ""
    assert warning.startswith(
        "round 2: training diverged: non-finite values from london (train loss nan)"
    )
    assert "site(s) london (810) are far from unit scale" in warning
    assert "standardize-features" in warning
    repo, run_id = ledger
    # The NaN is no number the ledger keeps; the warning is the run's note.
    assert [u.train_loss for u in repo.list_updates(run_id, round=2, site="london")] == [None]
    assert repo.get_run(run_id).error == warning
    assert repo.list_sites(run_id)[0].profile["feature_scale"] == 810.0
    repo.finish_run(run_id, status="finished")
    record = repo.get_run(run_id)
    assert (record.status, record.error) == ("finished", warning)


@pytest.mark.usefixtures("task_identity")
def test_a_plain_client_gets_the_report_without_the_hint(
    ledger: tuple[LedgerRepository, int],
) -> None:
    # Sites that say nothing of their features; round 3's loss is 15× round 1's.
    grid = ScriptedGrid({1: site("a", [1.0, 1.2, 15.0]), 2: site("b", [1.0, 0.8, 15.0])})
    seen = run(grid, ledger)
    assert [s.warning for s in seen] == [
        None,
        None,
        "round 3: training diverged: train loss 15 is more than 10× the first loss 1 "
        "(round 1's train loss)",
        None,
    ]
    repo, run_id = ledger
    # A run that then fails keeps the warning after its reason.
    repo.finish_run(run_id, status="failed", error="stopped")
    assert repo.get_run(run_id).error == f"stopped; {seen[2].warning}"


@pytest.mark.usefixtures("task_identity")
def test_an_update_the_guard_held_then_rejected_sets_no_first_loss(
    ledger: tuple[LedgerRepository, int],
) -> None:
    """Round 1's updates wait for three norms and are judged together; the one rejected
    then (its norm beyond a hundred medians) was counted by the divergence watch as applied,
    and its tiny first-batch loss over a huge claimed count made every later round a
    false "training diverged" note on the run."""

    def replying(values: np.ndarray, loss: float, first: float, examples: int) -> RecordDict:
        arrays = ArrayRecord({"w": Array(values)})
        metrics = {keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: loss, keys.FIRST_BATCH_LOSS: first}
        return RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord(metrics)})

    def hostile(msg: Message) -> Message:
        content = replying(np.full(4, 1e6, np.float32), 1e-9, 1e-9, 10**12)
        return Message(content, reply_to=msg)

    def honest(msg: Message) -> Message:  # a new step each time (the same twice: a replay)
        stepped = msg.content[keys.ARRAYS]["w"].numpy() + np.float32(0.1)
        return Message(replying(stepped, 2.0, 2.4, 10), reply_to=msg)

    # "a" is judged first: held for the round's first three norms, then rejected
    grid = ScriptedGrid(
        {1: scripted("a", hostile), 2: scripted("b", honest), 3: scripted("c", honest)}
    )
    seen = run(grid, ledger, guard=UpdateGuard())  # the platform's default guard (start()'s)
    assert [s.warning for s in seen] == [None] * 4
    repo, run_id = ledger
    rejected = repo.list_updates(run_id, round=1, site="a")
    assert [u.status for u in rejected] == ["rejected"]
    assert "beyond 100x" in (rejected[0].reason or "")
    assert repo.get_run(run_id).error is None


@pytest.mark.usefixtures("task_identity")
def test_a_strategys_warning_about_the_run_is_the_rounds_and_the_runs_note(
    ledger: tuple[LedgerRepository, int],
) -> None:
    """An own ServerApp's trimmed mean over two sites cuts nothing (known only once its
    sites answer): said with round 1, as a divergence report is, so the console shows it
    while the run trains and ``history`` with the run, not only the run's log file."""
    grid = ScriptedGrid({1: site("a", [1.0]), 2: site("b", [1.0])})
    seen = run(grid, ledger, strategy=LocalSGDAveraging(aggregator="trimmed-mean"))
    warnings = [s.warning for s in seen]
    assert warnings[1:] == [None, None, None]
    assert warnings[0] is not None and warnings[0].startswith(
        "aggregator 'trimmed-mean' with trim-fraction 0.2: a round combines at most 2 "
        "updates and cuts int(0.2 x 2) = 0 of them at each end: the plain mean"
    )
    repo, run_id = ledger
    assert repo.get_run(run_id).error == warnings[0]
