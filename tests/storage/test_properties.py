"""Property: whatever batches of updates are recorded, SQL aggregates equal a naive loop."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import UPDATE_STATUSES, LedgerRepository, UpdateInput
from tests.storage.helpers import T0, assert_summary_matches, make_run, naive_summary

SITES = ("london", "ohio", "tokyo")

losses = st.one_of(
    st.none(),
    st.just(math.nan),
    st.just(math.inf),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False),
)
updates = st.builds(
    UpdateInput,
    site=st.sampled_from(SITES),
    dispatched_round=st.integers(0, 50),
    version_trained_on=st.integers(0, 50),
    staleness=st.integers(0, 2**31 - 1),
    bytes_up=st.integers(0, 2**50),
    bytes_down=st.integers(0, 2**50),
    status=st.sampled_from(UPDATE_STATUSES),
    dispatched_at=st.floats(T0, T0 + 1e6),
    arrived_at=st.none() | st.floats(T0, T0 + 1e6),
    compute_seconds=st.none() | st.floats(0.0, 1e4),
    reason=st.none() | st.text(max_size=20),
    num_examples=st.none() | st.integers(0, 10**6),
    train_loss=losses,
)
# Up to three rounds of up to eight updates each.
batches = st.lists(st.lists(updates, max_size=8), min_size=1, max_size=3)


def test_site_summaries_equal_naive_aggregation(repo: LedgerRepository) -> None:
    # PostgreSQL examples cost a round trip per statement; fewer of them keep the suite fast.
    examples = 40 if repo.url.startswith("sqlite") else 15

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(batches=batches)
    def check(batches: list[list[UpdateInput]]) -> None:
        run_id = make_run(repo)  # a fresh run per example: examples never see each other
        for name in SITES:
            repo.add_site(run_id, name=name, node_id=2**64 - len(name))
        for step, batch in enumerate(batches, start=1):
            repo.record_round(
                run_id,
                round=step,
                model_version=step,
                started_at=T0,
                finished_at=T0 + 1,
                metrics={},
                train_loss=None,
                updates=batch,
            )

        summaries = {s.name: s for s in repo.site_summaries(run_id)}
        stored = repo.list_updates(run_id)
        assert set(summaries) == set(SITES)
        for name in SITES:
            given_rows = [u for batch in batches for u in batch if u.site == name]
            stored_rows = [u for u in stored if u.site == name]
            assert_summary_matches(summaries[name], naive_summary(given_rows))
            assert_summary_matches(summaries[name], naive_summary(stored_rows))
        for step, (batch, rnd) in enumerate(zip(batches, repo.list_rounds(run_id), strict=True), 1):
            assert rnd.round == step
            assert (rnd.bytes_up, rnd.bytes_down) == (
                sum(u.bytes_up for u in batch),
                sum(u.bytes_down for u in batch),
            )
            assert (rnd.num_applied, rnd.num_dropped, rnd.num_rejected) == tuple(
                sum(u.status == s for u in batch) for s in ("applied", "dropped", "rejected")
            )

    check()
