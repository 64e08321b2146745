"""Property: whatever batches of updates and evaluations are recorded, SQL aggregates equal a
naive loop; the summary maths equals its definition."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import (
    EVALUATION_STATUSES,
    UPDATE_STATUSES,
    EvaluationInput,
    LedgerRepository,
    UpdateInput,
)
from storage.summaries import nearest_rank_p90, waiting_and_busy
from tests.helpers.ledger_records import (
    T0,
    assert_summary_matches,
    make_run,
    naive_eval_traffic,
    naive_p90,
    naive_run_clock,
    naive_summary,
    naive_waiting_and_busy,
    update,
)

SITES = ("london", "ohio", "tokyo")

losses = st.one_of(
    st.none(),
    st.just(math.nan),
    st.just(math.inf),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False),
)
# Wall times on a 1/64 s grid, which datetimes hold exactly (15625 us), so the oracle over
# the given floats and the summary over the stored datetimes order and subtract alike.
wall_times = st.integers(0, 64 * 10**6).map(lambda k: T0 + k / 64)
seconds = st.floats(0.0, 1e4, allow_nan=False)


@st.composite
def updates(draw: st.DrawFn, clock: str) -> UpdateInput:
    """An update of a run on ``clock``: "wall" (no virtual times), "virtual" (all have
    them) or "mixed" (some lack a virtual dispatch time, as a wall-only row would)."""
    virtual: dict[str, float | None] = {}
    if clock == "virtual" or (clock == "mixed" and draw(st.booleans())):
        dispatched = draw(st.floats(0.0, 1e5, allow_nan=False))
        virtual = {
            "virtual_dispatched_at": dispatched,
            # Ties (an instant reply, equal dispatches) are where ordering bugs hide.
            "virtual_arrived_at": draw(
                st.none() | st.just(dispatched) | seconds.map(dispatched.__add__)
            ),
            "virtual_compute_seconds": draw(st.none() | seconds),
            "transfer_seconds": draw(st.none() | seconds),
        }
    return UpdateInput(
        site=draw(st.sampled_from(SITES)),
        dispatched_round=draw(st.integers(0, 50)),
        version_trained_on=draw(st.integers(0, 50)),
        # Small values collide, so the staleness histogram has counts above 1.
        staleness=draw(st.integers(0, 3) | st.integers(0, 2**31 - 1)),
        bytes_up=draw(st.integers(0, 2**50)),
        bytes_down=draw(st.integers(0, 2**50)),
        status=draw(st.sampled_from(UPDATE_STATUSES)),
        dispatched_at=draw(wall_times),
        arrived_at=draw(st.none() | wall_times),
        compute_seconds=draw(st.none() | seconds),
        reason=draw(st.none() | st.text(max_size=20)),
        num_examples=draw(st.none() | st.integers(0, 10**6)),
        train_loss=draw(losses),
        # The delayed strategy's columns; only delay is summarised (over applied updates).
        period=draw(st.none() | st.integers(0, 50)),
        average_applied=draw(st.none() | st.integers(0, 50)),
        delay=draw(st.none() | st.integers(0, 3) | st.integers(0, 2**31 - 1)),
        # Streaming sync's column; never summarised.
        fragment=draw(st.none() | st.integers(0, 2**31 - 1)),
        **virtual,
    )


evaluations = st.builds(
    EvaluationInput,
    site=st.sampled_from(SITES),
    model_version=st.integers(0, 50),
    bytes_up=st.integers(0, 2**50),
    bytes_down=st.integers(0, 2**50),
    status=st.sampled_from(EVALUATION_STATUSES),
    dispatched_at=st.floats(T0, T0 + 1e6),
    arrived_at=st.none() | st.floats(T0, T0 + 1e6),
    reason=st.none() | st.text(max_size=20),
    num_examples=st.none() | st.integers(0, 10**6),
    loss=losses,
    accuracy=losses,
)
Batch = tuple[list[UpdateInput], list[EvaluationInput]]
# Up to three rounds of up to eight updates and at most one evaluation per site each, all
# updates of a run on one clock.
batches = st.sampled_from(["wall", "virtual", "mixed"]).flatmap(
    lambda clock: st.lists(
        st.tuples(
            st.lists(updates(clock), max_size=8),
            st.lists(evaluations, max_size=len(SITES), unique_by=lambda e: e.site),
        ),
        min_size=1,
        max_size=3,
    )
)


def test_site_summaries_equal_naive_aggregation(repo: LedgerRepository) -> None:
    # PostgreSQL examples cost a round trip per statement; fewer of them keep the suite fast.
    examples = 40 if repo.url.startswith("sqlite") else 15

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(batches=batches)
    def check(batches: list[Batch]) -> None:
        run_id = make_run(repo)  # a fresh run per example: examples never see each other
        for name in SITES:
            repo.add_site(run_id, name=name, node_id=2**64 - len(name))
        for step, (batch, evals) in enumerate(batches, start=1):
            repo.record_round(
                run_id,
                round=step,
                model_version=step,
                started_at=T0,
                finished_at=T0 + 1,
                metrics={},
                train_loss=None,
                updates=batch,
                evaluations=evals,
            )

        summaries = {s.name: s for s in repo.site_summaries(run_id)}
        stored = repo.list_updates(run_id)
        stored_evals = repo.list_evaluations(run_id)
        assert [
            (e.round, e.site, e.model_version, e.status, e.loss, e.accuracy) for e in stored_evals
        ] == [
            (step, e.site, e.model_version, e.status, e.loss, e.accuracy)
            for step, (_, evals) in enumerate(batches, start=1)
            for e in evals
        ]
        assert set(summaries) == set(SITES)
        clock = naive_run_clock(u for batch, _ in batches for u in batch)
        for name in SITES:
            given_rows = [u for batch, _ in batches for u in batch if u.site == name]
            stored_rows = [u for u in stored if u.site == name]
            assert_summary_matches(summaries[name], naive_summary(given_rows, clock=clock))
            assert_summary_matches(summaries[name], naive_summary(stored_rows, clock=clock))
            given_evals = [e for _, evals in batches for e in evals if e.site == name]
            s = summaries[name]
            assert (s.evaluations, s.eval_bytes_up, s.eval_bytes_down) == (
                naive_eval_traffic(given_evals)
            )
        rounds = repo.list_rounds(run_id)
        for step, ((batch, evals), rnd) in enumerate(zip(batches, rounds, strict=True), 1):
            assert rnd.round == step
            assert (rnd.eval_bytes_up, rnd.eval_bytes_down) == naive_eval_traffic(evals)[1:]
            assert (rnd.bytes_up, rnd.bytes_down) == (
                sum(u.bytes_up for u in batch),
                sum(u.bytes_down for u in batch),
            )
            assert (rnd.num_applied, rnd.num_dropped, rnd.num_rejected) == tuple(
                sum(u.status == s for u in batch) for s in ("applied", "dropped", "rejected")
            )

    check()


@given(st.lists(st.integers(0, 6) | st.integers(0, 2**31 - 1), max_size=40))
def test_nearest_rank_p90_is_the_definition(values: list[int]) -> None:
    assert nearest_rank_p90(Counter(values)) == naive_p90(values)


intervals = st.lists(
    st.tuples(st.integers(0, 20), st.none() | st.integers(0, 25)).map(
        lambda t: (float(t[0]), None if t[1] is None else float(t[1]))
    ),
    max_size=12,
)


@given(intervals)
def test_waiting_and_busy_is_the_definition(
    given_intervals: list[tuple[float, float | None]],
) -> None:
    # Small integers: many ties and overlaps, and sums that floats hold exactly.
    rows = [
        update("a", virtual_dispatched_at=d, virtual_arrived_at=a, dispatched_at=T0)
        for d, a in given_intervals
        if a is None or a >= d
    ]
    times = [(d, a) for d, a in given_intervals if a is None or a >= d]
    assert waiting_and_busy(times) == naive_waiting_and_busy(rows, "virtual")
    # Wall-clock intervals may end before they start (clocks are not checked); still defined.
    assert waiting_and_busy(given_intervals) == naive_waiting_and_busy(
        [
            update("a", dispatched_at=T0 + d, arrived_at=None if a is None else T0 + a)
            for d, a in given_intervals
        ],
        "wall",
    )
