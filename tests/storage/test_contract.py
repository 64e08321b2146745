"""The ledger contract: the same tests on every backend (``repo`` is parametrized)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from flplatform.core.errors import NotFoundError, StorageError
from storage import (
    CheckpointInput,
    CheckpointRecord,
    EvaluationInput,
    LedgerRepository,
    TrafficInput,
    UpdateInput,
    UpdateStatus,
)
from tests.helpers.ledger_records import (
    T0,
    assert_summary_matches,
    evaluation,
    make_run,
    naive_eval_traffic,
    naive_summary,
    record,
    update,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
UINT64_MAX = 2**64 - 1


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def count_rows(repo: LedgerRepository, table: str) -> int:
    with repo._engine.connect() as connection:
        return int(connection.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


# ---------------------------------------------------------------------------- runs
def test_run_round_trips_every_field(repo: LedgerRepository) -> None:
    config = {"lr": 0.1, "sites": ["a", "b"], "nested": {"k": 3, "flag": True, "none": None}}
    run_id = make_run(
        repo,
        name="exp",
        strategy="fetchsgd",
        seed=-(2**63),
        config=config,
        num_rounds_planned=20,
        tag="tag-1",
        created_at=T0,
    )

    run = repo.get_run(run_id)

    assert (run.id, run.tag, run.name, run.strategy) == (run_id, "tag-1", "exp", "fetchsgd")
    assert (run.seed, run.config, run.num_rounds_planned) == (-(2**63), config, 20)
    assert (run.status, run.error, run.finished_at, run.wall_seconds) == (
        "running",
        None,
        None,
        None,
    )
    assert run.final_metrics is None
    assert run.created_at == utc(T0)
    assert run.created_at.tzinfo is not None and run.created_at.utcoffset() == timedelta(0)
    assert (run.rounds_completed, run.last_metrics) == (0, {})


def test_finish_run_records_outcome_and_wall_time(repo: LedgerRepository) -> None:
    run_id = make_run(repo, created_at=T0)

    repo.finish_run(
        run_id,
        status="failed",
        error="site london crashed",
        final_metrics={"accuracy": 0.93},
        finished_at=T0 + 125.5,
    )

    run = repo.get_run(run_id)
    assert (run.status, run.error, run.final_metrics) == (
        "failed",
        "site london crashed",
        {"accuracy": 0.93},
    )
    assert run.finished_at == utc(T0 + 125.5)
    assert run.wall_seconds == pytest.approx(125.5, abs=1e-5)


def test_a_rounds_run_warning_is_kept_when_the_run_finishes_or_fails(
    repo: LedgerRepository,
) -> None:
    finished, failed = make_run(repo, created_at=T0), make_run(repo, created_at=T0)
    for run_id in (finished, failed):
        record(repo, run_id, 1, [], run_warning="round 1: training diverged: loss nan\x00")
        record(repo, run_id, 2, [], run_warning=None)
        # Written with its round: a reader never sees one without the other.
        assert repo.get_run(run_id).error == "round 1: training diverged: loss nan\ufffd"
    with pytest.raises(StorageError, match="run_warning must be a string"):
        record(repo, finished, 3, [], run_warning=3)
    assert repo.get_run(finished).rounds_completed == 2
    repo.finish_run(finished, status="finished", finished_at=T0 + 60)
    repo.finish_run(failed, status="failed", error="stopped", finished_at=T0 + 60)
    assert repo.get_run(finished).error == "round 1: training diverged: loss nan\ufffd"
    assert repo.get_run(failed).error == "stopped; round 1: training diverged: loss nan\ufffd"


def test_finish_run_refuses_bad_status_a_second_finish_and_time_travel(
    repo: LedgerRepository,
) -> None:
    run_id = make_run(repo, created_at=T0)
    with pytest.raises(StorageError, match="'finished' or 'failed'"):
        repo.finish_run(run_id, status="running")  # type: ignore[arg-type]
    with pytest.raises(StorageError, match="before run"):
        repo.finish_run(run_id, status="finished", finished_at=T0 - 1)
    repo.finish_run(run_id, status="finished", finished_at=T0 + 1)
    with pytest.raises(StorageError, match="already finished"):
        repo.finish_run(run_id, status="failed", finished_at=T0 + 2)
    assert repo.get_run(run_id).status == "finished"


def test_tags_are_unique_and_findable(repo: LedgerRepository) -> None:
    first = make_run(repo, tag="cli-42")
    make_run(repo)  # untagged runs do not collide with each other
    make_run(repo)

    with pytest.raises(StorageError, match="already exists"):
        make_run(repo, tag="cli-42")

    found = repo.find_run_by_tag("cli-42")
    assert found is not None and found.id == first
    assert repo.find_run_by_tag("nope") is None
    assert len(repo.list_runs()) == 3


def test_list_runs_is_newest_first_with_progress(repo: LedgerRepository) -> None:
    old = make_run(repo, name="old", created_at=T0)
    new = make_run(repo, name="new", created_at=T0 + 100)
    middle = make_run(repo, name="middle", created_at=T0 + 50)
    repo.add_site(middle, name="a", node_id=1)
    # Recorded out of order: "last metrics" must come from the highest round, not the last row.
    record(repo, middle, 2, [update("a")], metrics={"accuracy": 0.8})
    record(repo, middle, 1, [update("a")], metrics={"accuracy": 0.6})

    runs = repo.list_runs()

    assert [r.id for r in runs] == [new, middle, old]
    assert [r.rounds_completed for r in runs] == [0, 2, 0]
    assert runs[1].last_metrics == {"accuracy": 0.8}
    assert [r.id for r in repo.list_runs(limit=2)] == [new, middle]
    assert repo.get_run(middle).rounds_completed == 2


# ---------------------------------------------------------------------------- sites
@pytest.mark.parametrize("node_id", [0, 1, 2**63 - 1, 2**63, UINT64_MAX])
def test_site_round_trips_every_field(repo: LedgerRepository, node_id: int) -> None:
    run_id = make_run(repo)
    profile = {"latency_ms": 140.0, "bandwidth_mbit": 23, "compute": {"model": "pareto"}}

    site_id = repo.add_site(
        run_id, name="london", node_id=node_id, partition_id=3, num_examples=450, profile=profile
    )

    [site] = repo.list_sites(run_id)
    assert (site.id, site.run_id, site.name, site.node_id) == (site_id, run_id, "london", node_id)
    assert (site.partition_id, site.num_examples, site.profile) == (3, 450, profile)
    assert repo.site_summaries(run_id)[0].node_id == node_id


def test_sites_are_listed_in_insertion_order_and_a_name_added_again_rejoins(
    repo: LedgerRepository,
) -> None:
    run_a, run_b = make_run(repo), make_run(repo)
    ids = {name: repo.add_site(run_a, name=name, node_id=len(name)) for name in ("tokyo", "london")}
    repo.add_site(run_a, name="ohio", node_id=4, partition_id=2, profile={"latency_ms": 5.0})
    repo.add_site(run_b, name="london", node_id=1)  # same name, other run: another site

    # A resumed run's site comes back under its name with a new Flower node id: same row.
    assert repo.add_site(run_a, name="london", node_id=99, num_examples=10) == ids["london"]
    repo.add_site(run_a, name="ohio", node_id=5)

    sites = {s.name: s for s in repo.list_sites(run_a)}
    assert list(sites) == ["tokyo", "london", "ohio"]
    assert (sites["london"].node_id, sites["london"].num_examples) == (99, 10)
    # Facts not given again are kept.
    assert (sites["ohio"].node_id, sites["ohio"].partition_id) == (5, 2)
    assert sites["ohio"].profile == {"latency_ms": 5.0}
    assert [(s.name, s.node_id) for s in repo.list_sites(run_b)] == [("london", 1)]


@pytest.mark.parametrize("node_id", [-1, 2**64, True, 1.5])
def test_add_site_refuses_node_ids_outside_uint64(repo: LedgerRepository, node_id: Any) -> None:
    run_id = make_run(repo)
    with pytest.raises(StorageError, match="node_id"):
        repo.add_site(run_id, name="x", node_id=node_id)
    assert repo.list_sites(run_id) == []


# ---------------------------------------------------------------------------- rounds
def test_round_and_updates_round_trip_every_field(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    london = repo.add_site(run_id, name="london", node_id=UINT64_MAX)
    tokyo = repo.add_site(run_id, name="tokyo", node_id=5)
    applied = UpdateInput(
        site="london",
        dispatched_round=3,
        version_trained_on=2,
        staleness=1,
        bytes_up=3_000_000_000_000,
        bytes_down=1234,
        status="applied",
        dispatched_at=T0 + 30.125,
        arrived_at=T0 + 41.5,
        compute_seconds=9.75,
        reason=None,
        num_examples=450,
        train_loss=0.321,
    )
    dropped = UpdateInput(
        site="tokyo",
        dispatched_round=4,
        version_trained_on=3,
        staleness=0,
        bytes_up=0,
        bytes_down=99,
        status="dropped",
        dispatched_at=T0 + 40.0,
        reason="deadline passed",
    )
    rejected = update("tokyo", "rejected", bytes_up=7, bytes_down=8, reason="non-finite")

    repo.record_round(
        run_id,
        round=4,
        model_version=3,
        started_at=T0 + 40,
        finished_at=T0 + 42.5,
        metrics={"accuracy": 0.95, "loss": 0.2},
        train_loss=0.31,
        updates=[applied, dropped, rejected],
    )

    [rnd] = repo.list_rounds(run_id)
    assert (rnd.run_id, rnd.round, rnd.model_version) == (run_id, 4, 3)
    assert (rnd.started_at, rnd.finished_at) == (utc(T0 + 40), utc(T0 + 42.5))
    assert rnd.wall_seconds == pytest.approx(2.5)
    assert (rnd.metrics, rnd.train_loss) == ({"accuracy": 0.95, "loss": 0.2}, 0.31)
    assert (rnd.num_applied, rnd.num_dropped, rnd.num_rejected) == (1, 1, 1)
    assert (rnd.bytes_up, rnd.bytes_down) == (3_000_000_000_007, 1234 + 99 + 8)

    got = repo.list_updates(run_id)
    assert [(u.site, u.site_id, u.status) for u in got] == [
        ("london", london, "applied"),
        ("tokyo", tokyo, "dropped"),
        ("tokyo", tokyo, "rejected"),
    ]
    first, second = got[0], got[1]
    assert (first.run_id, first.round, first.dispatched_round) == (run_id, 4, 3)
    assert (first.version_trained_on, first.staleness) == (2, 1)
    assert (first.bytes_up, first.bytes_down) == (3_000_000_000_000, 1234)
    assert (first.compute_seconds, first.reason, first.num_examples) == (9.75, None, 450)
    assert first.train_loss == 0.321
    assert (first.dispatched_at, first.arrived_at) == (utc(T0 + 30.125), utc(T0 + 41.5))
    assert all(u.dispatched_at.utcoffset() == timedelta(0) for u in got)
    assert (second.arrived_at, second.compute_seconds, second.train_loss) == (None, None, None)
    assert (second.reason, second.num_examples) == ("deadline passed", None)


def test_rounds_are_listed_by_round_number(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    for step in (3, 1, 2):
        record(repo, run_id, step, [update("a", dispatched_round=step)])

    assert [r.round for r in repo.list_rounds(run_id)] == [1, 2, 3]
    assert [u.round for u in repo.list_updates(run_id)] == [1, 2, 3]


def test_reads_through_a_snapshot_see_the_ledger_at_one_moment(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")])

    with repo.snapshot() as snapshot:
        assert snapshot.get_run(run_id).rounds_completed == 1
        # Another connection records a round and finishes the run between two reads.
        record(repo, run_id, 2, [update("a", status="rejected", reason="late")])
        repo.finish_run(run_id, status="finished")
        assert [r.round for r in snapshot.list_rounds(run_id)] == [1]
        assert [u.round for u in snapshot.list_updates(run_id)] == [1]
        assert snapshot.get_run(run_id).status == "running"
        assert [r.round for r in repo.list_rounds(run_id)] == [1, 2]  # it was committed
        with pytest.raises(StorageError, match="only reads"):
            snapshot.add_event(run_id, "note", {})
    with pytest.raises(StorageError, match="closed"):
        snapshot.list_rounds(run_id)
    assert repo.get_run(run_id).rounds_completed == 2  # the repository is still open


def test_a_round_is_recorded_once(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")], model_version=1)

    with pytest.raises(StorageError, match="already recorded"):
        record(repo, run_id, 1, [update("a"), update("a")], model_version=9)

    [rnd] = repo.list_rounds(run_id)
    assert rnd.model_version == 1
    assert len(repo.list_updates(run_id)) == 1


@pytest.mark.parametrize(
    ("status", "error"), [("failed", "stopped by the user (SIGINT)"), ("finished", None)]
)
def test_a_run_no_longer_running_takes_no_rounds_or_sites(
    repo: LedgerRepository, status: Any, error: str | None
) -> None:
    """A ServerApp that outlives the command that stopped its run stops at its next write."""
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")])
    repo.finish_run(run_id, status=status, error=error)

    because = rf" \({re.escape(error)}\)" if error else ";"
    with pytest.raises(
        StorageError, match=rf"record round 2 of run {run_id}: run {run_id} is {status}{because}"
    ):
        record(repo, run_id, 2, [update("a", dispatched_round=2)])
    with pytest.raises(StorageError, match="takes no rows once it has finished or failed"):
        repo.add_site(run_id, name="b", node_id=2)

    assert [r.round for r in repo.list_rounds(run_id)] == [1]
    assert len(repo.list_updates(run_id)) == 1
    assert [s.name for s in repo.list_sites(run_id)] == ["a"]
    assert repo.get_run(run_id).status == status


def test_unknown_site_leaves_neither_round_nor_updates(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)

    with pytest.raises(StorageError, match="'ghost'"):
        record(repo, run_id, 1, [update("a"), update("a"), update("ghost")])

    assert repo.list_rounds(run_id) == []
    assert repo.list_updates(run_id) == []
    assert repo.get_run(run_id).rounds_completed == 0


def test_a_failure_while_writing_updates_rolls_back_the_round(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    seen: list[str] = []

    def fail_on_updates(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        head = " ".join(statement.split()[:3]).upper()
        seen.append(head)
        if head == "INSERT INTO UPDATES":
            raise RuntimeError("disk on fire")

    event.listen(repo._engine, "before_cursor_execute", fail_on_updates)
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            record(repo, run_id, 1, [update("a"), update("a")])
    finally:
        event.remove(repo._engine, "before_cursor_execute", fail_on_updates)

    assert "INSERT INTO ROUNDS" in seen  # the round row really was written before the failure
    assert repo.list_rounds(run_id) == []
    assert count_rows(repo, "updates") == 0


def test_round_inputs_are_validated(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    with pytest.raises(StorageError, match="round must be >= 1"):
        record(repo, run_id, 0, [])
    with pytest.raises(StorageError, match="before started_at"):
        record(repo, run_id, 1, [], started_at=T0 + 5, finished_at=T0)
    with pytest.raises(StorageError, match="metrics"):
        record(repo, run_id, 1, [], metrics={"accuracy": "high"})
    with pytest.raises(StorageError, match=r"updates\[0\]"):
        record(repo, run_id, 1, [{"site": "a"}])  # type: ignore[list-item]
    assert repo.list_rounds(run_id) == []


def test_non_finite_floats_are_stored_as_null(repo: LedgerRepository) -> None:
    nan, inf = math.nan, math.inf
    run_id = make_run(repo, config={"timeout": inf, "ok": 1.5})
    repo.add_site(run_id, name="a", node_id=1, profile={"jitter": nan})
    record(
        repo,
        run_id,
        1,
        [update("a", train_loss=nan)],
        metrics={"loss": nan, "up": inf, "down": -inf, "accuracy": 0.1},
        train_loss=inf,
    )
    repo.finish_run(run_id, status="failed", final_metrics={"loss": nan}, finished_at=T0 + 99)

    run = repo.get_run(run_id)
    [rnd] = repo.list_rounds(run_id)
    assert run.config == {"timeout": None, "ok": 1.5}
    assert run.final_metrics == {"loss": None}
    assert repo.list_sites(run_id)[0].profile == {"jitter": None}
    assert rnd.metrics == {"loss": None, "up": None, "down": None, "accuracy": 0.1}
    assert rnd.train_loss is None
    assert repo.list_updates(run_id)[0].train_loss is None
    assert repo.site_summaries(run_id)[0].mean_train_loss is None
    # The stored text is standard JSON (no NaN/Infinity tokens) that any JSON reader accepts.
    with repo._engine.connect() as connection:
        stored = connection.execute(text("SELECT metrics FROM rounds")).scalar_one()
    parsed = stored if isinstance(stored, dict) else json.loads(stored, parse_constant=_refuse)
    assert parsed["loss"] is None


def test_nul_characters_are_refused_in_names_and_replaced_in_free_text(
    repo: LedgerRepository,
) -> None:
    # PostgreSQL refuses NUL in text columns; SQLite stores it. Both must behave alike.
    with pytest.raises(StorageError, match="run name must not contain NUL"):
        make_run(repo, name="a\x00b")
    run_id = make_run(repo)
    with pytest.raises(StorageError, match="site name must not contain NUL"):
        repo.add_site(run_id, name="\x00", node_id=1)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a", "rejected", reason="bad\x00payload")])
    repo.finish_run(run_id, status="failed", error="boom\x00", finished_at=T0 + 1)

    assert repo.list_updates(run_id)[0].reason == "bad\ufffdpayload"
    assert repo.get_run(run_id).error == "boom\ufffd"


def _refuse(token: str) -> None:
    raise AssertionError(f"non-standard JSON token {token}")


# ---------------------------------------------------------------------------- updates
def test_list_updates_filters_by_round_and_site(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    for name in ("a", "b"):
        repo.add_site(run_id, name=name, node_id=ord(name))
    record(repo, run_id, 1, [update("a"), update("b"), update("a", "buffered")])
    record(repo, run_id, 2, [update("b", "dropped")])

    assert [(u.round, u.site, u.status) for u in repo.list_updates(run_id, site="a")] == [
        (1, "a", "applied"),
        (1, "a", "buffered"),
    ]
    assert [u.site for u in repo.list_updates(run_id, round=2)] == ["b"]
    assert [u.status for u in repo.list_updates(run_id, round=1, site="b")] == ["applied"]
    assert repo.list_updates(run_id, round=7) == []
    with pytest.raises(NotFoundError, match="no site 'c'"):
        repo.list_updates(run_id, site="c")


def test_site_summaries_match_a_naive_aggregation(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    for name in ("london", "ohio", "tokyo", "idle"):
        repo.add_site(run_id, name=name, node_id=len(name), partition_id=len(name), num_examples=10)
    record(
        repo,
        run_id,
        1,
        [
            update("london", staleness=0, bytes_up=10, train_loss=0.5, compute_seconds=1.25),
            update("ohio", "buffered", staleness=2, bytes_up=20, train_loss=None),
            update(
                "tokyo", "dropped", staleness=3, bytes_up=0, train_loss=None, compute_seconds=None
            ),
        ],
    )
    record(
        repo,
        run_id,
        2,
        [
            update("london", "rejected", staleness=1, bytes_up=2**40, train_loss=2.0),
            update("ohio", "applied", staleness=5, bytes_up=30, train_loss=0.25),
            update("tokyo", "cancelled", staleness=4, bytes_down=0, train_loss=None),
            update("london", "applied", staleness=2, train_loss=0.125, compute_seconds=0.5),
        ],
    )

    summaries = repo.site_summaries(run_id)

    assert [s.name for s in summaries] == ["london", "ohio", "tokyo", "idle"]
    updates = repo.list_updates(run_id)
    for summary in summaries:
        assert_summary_matches(summary, naive_summary(u for u in updates if u.site == summary.name))
    idle = summaries[-1]
    assert (idle.updates, idle.mean_staleness, idle.max_staleness) == (0, None, None)
    assert (idle.partition_id, idle.num_examples, idle.node_id) == (4, 10, 4)
    assert summaries[0].bytes_up == 10 + 2**40 + 100


# ---------------------------------------------------------------------------- evaluations
def test_round_and_evaluations_round_trip_every_field(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    london = repo.add_site(run_id, name="london", node_id=UINT64_MAX)
    tokyo = repo.add_site(run_id, name="tokyo", node_id=5)
    evaluated = EvaluationInput(
        site="london",
        model_version=3,
        bytes_up=3_000_000_000_000,
        bytes_down=4321,
        status="evaluated",
        dispatched_at=T0 + 40.125,
        arrived_at=T0 + 41.5,
        num_examples=120,
        loss=0.375,
        accuracy=0.9375,
    )
    dropped = EvaluationInput(
        site="tokyo",
        model_version=3,
        bytes_up=0,
        bytes_down=4321,
        status="dropped",
        dispatched_at=T0 + 40.25,
        reason="deadline passed",
    )

    repo.record_round(
        run_id,
        round=4,
        model_version=3,
        started_at=T0 + 40,
        finished_at=T0 + 42.5,
        metrics={"accuracy": 0.95},
        train_loss=0.31,
        updates=[update("london", bytes_up=10, bytes_down=20)],
        evaluations=[evaluated, dropped],
    )

    [rnd] = repo.list_rounds(run_id)
    assert (rnd.bytes_up, rnd.bytes_down) == (10, 20)  # updates only
    assert (rnd.eval_bytes_up, rnd.eval_bytes_down) == (3_000_000_000_000, 2 * 4321)
    got = repo.list_evaluations(run_id)
    assert [(e.site, e.site_id, e.status) for e in got] == [
        ("london", london, "evaluated"),
        ("tokyo", tokyo, "dropped"),
    ]
    first, second = got
    assert (first.run_id, first.round, first.model_version) == (run_id, 4, 3)
    assert (first.bytes_up, first.bytes_down) == (3_000_000_000_000, 4321)
    assert (first.num_examples, first.loss, first.accuracy, first.reason) == (
        120,
        0.375,
        0.9375,
        None,
    )
    assert (first.dispatched_at, first.arrived_at) == (utc(T0 + 40.125), utc(T0 + 41.5))
    assert all(e.dispatched_at.utcoffset() == timedelta(0) for e in got)
    assert (second.arrived_at, second.num_examples, second.loss, second.accuracy) == (
        None,
        None,
        None,
        None,
    )
    assert (second.reason, second.bytes_up) == ("deadline passed", 0)
    # Recording evaluations leaves the update accounting as it was.
    assert len(repo.list_updates(run_id)) == 1


def test_rounds_without_evaluations_have_zero_eval_traffic(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")])
    record(repo, run_id, 2, [], evaluations=[evaluation("a", bytes_up=5, bytes_down=6)])
    record(repo, run_id, 3, [update("a")], evaluations=[])

    rounds = repo.list_rounds(run_id)
    assert [(r.round, r.eval_bytes_up, r.eval_bytes_down) for r in rounds] == [
        (1, 0, 0),
        (2, 5, 6),
        (3, 0, 0),
    ]
    assert all(type(r.eval_bytes_up) is int for r in rounds)
    [summary] = repo.site_summaries(run_id)
    assert (summary.evaluations, summary.eval_bytes_up, summary.eval_bytes_down) == (1, 5, 6)


def test_unknown_evaluation_site_leaves_no_round_updates_or_evaluations(
    repo: LedgerRepository,
) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)

    with pytest.raises(StorageError, match="evaluation from site 'ghost'"):
        record(repo, run_id, 1, [update("a")], evaluations=[evaluation("a"), evaluation("ghost")])

    assert repo.list_rounds(run_id) == []
    assert repo.list_updates(run_id) == []
    assert repo.list_evaluations(run_id) == []
    assert count_rows(repo, "evaluations") == 0
    assert repo.get_run(run_id).rounds_completed == 0
    # The step can then be recorded properly.
    record(repo, run_id, 1, [update("a")], evaluations=[evaluation("a")])
    assert len(repo.list_evaluations(run_id)) == 1


def test_a_failure_while_writing_evaluations_rolls_back_the_round(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    seen: list[str] = []

    def fail_on_evaluations(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        head = " ".join(statement.split()[:3]).upper()
        seen.append(head)
        if head == "INSERT INTO EVALUATIONS":
            raise RuntimeError("disk on fire")

    event.listen(repo._engine, "before_cursor_execute", fail_on_evaluations)
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            record(repo, run_id, 1, [update("a")], evaluations=[evaluation("a")])
    finally:
        event.remove(repo._engine, "before_cursor_execute", fail_on_evaluations)

    assert {"INSERT INTO ROUNDS", "INSERT INTO UPDATES"} <= set(seen)
    assert repo.list_rounds(run_id) == []
    assert (count_rows(repo, "updates"), count_rows(repo, "evaluations")) == (0, 0)


def test_evaluation_inputs_are_validated_before_writing(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    with pytest.raises(StorageError, match=r"evaluations\[1\] must be an EvaluationInput"):
        record(repo, run_id, 1, [], evaluations=[evaluation("a"), update("a")])
    with pytest.raises(StorageError, match="two evaluations from site 'a'"):
        record(repo, run_id, 1, [], evaluations=[evaluation("a"), evaluation("a", "dropped")])
    assert repo.list_rounds(run_id) == []
    # One evaluation per site and step, but a site may be evaluated again at later steps.
    record(repo, run_id, 1, [], evaluations=[evaluation("a")])
    record(repo, run_id, 2, [], evaluations=[evaluation("a", model_version=2)])
    assert [(e.round, e.model_version) for e in repo.list_evaluations(run_id)] == [(1, 1), (2, 2)]


def test_the_schema_refuses_a_second_evaluation_of_a_site_in_a_step(
    repo: LedgerRepository,
) -> None:
    run_id = make_run(repo)
    site_id = repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [], evaluations=[evaluation("a")])
    row = {"run_id": run_id, "site_id": site_id, "round": 1, "model_version": 1, "bytes_up": 0}
    columns = ", ".join([*row, "bytes_down", "status", "dispatched_at"])
    values = ", ".join([f":{name}" for name in row] + ["0", "'dropped'", "CURRENT_TIMESTAMP"])
    with pytest.raises(Exception, match="(?i)unique"), repo._engine.begin() as connection:
        connection.execute(text(f"INSERT INTO evaluations ({columns}) VALUES ({values})"), row)
    assert count_rows(repo, "evaluations") == 1


def test_evaluation_floats_that_are_not_finite_are_stored_as_null(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    given = evaluation("a", loss=math.nan, accuracy=-math.inf, reason="bad\x00payload")
    assert (given.loss, given.accuracy) == (None, None)
    record(repo, run_id, 1, [], evaluations=[given])

    [stored] = repo.list_evaluations(run_id)
    assert (stored.loss, stored.accuracy, stored.reason) == (None, None, "bad\ufffdpayload")


def test_list_evaluations_filters_by_round_and_site(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    for name in ("a", "b"):
        repo.add_site(run_id, name=name, node_id=ord(name))
    record(repo, run_id, 1, [], evaluations=[evaluation("b"), evaluation("a", "dropped")])
    record(repo, run_id, 2, [update("a")], evaluations=[evaluation("a")])

    assert [(e.round, e.site, e.status) for e in repo.list_evaluations(run_id)] == [
        (1, "b", "evaluated"),
        (1, "a", "dropped"),
        (2, "a", "evaluated"),
    ]
    assert [(e.round, e.status) for e in repo.list_evaluations(run_id, site="a")] == [
        (1, "dropped"),
        (2, "evaluated"),
    ]
    assert [e.site for e in repo.list_evaluations(run_id, round=2)] == ["a"]
    assert [e.status for e in repo.list_evaluations(run_id, round=1, site="b")] == ["evaluated"]
    assert repo.list_evaluations(run_id, round=7) == []
    with pytest.raises(NotFoundError, match="no site 'c'"):
        repo.list_evaluations(run_id, site="c")
    with pytest.raises(StorageError, match="round"):
        repo.list_evaluations(run_id, round=-1)


def test_evaluation_aggregates_match_a_naive_computation(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    names = ("london", "ohio", "tokyo", "idle")
    for name in names:
        repo.add_site(run_id, name=name, node_id=len(name))
    given = {
        1: [
            evaluation("london", bytes_up=10, bytes_down=2**40),
            evaluation("ohio", "dropped", bytes_up=0, bytes_down=7),
        ],
        2: [],
        3: [
            evaluation("london", bytes_up=2**41, bytes_down=3),
            evaluation("ohio", bytes_up=5, bytes_down=6),
            evaluation("tokyo", "dropped", bytes_up=0, bytes_down=0),
        ],
    }
    for step, evals in given.items():
        record(repo, run_id, step, [update("london"), update("tokyo")], evaluations=evals)

    stored = repo.list_evaluations(run_id)
    for rnd in repo.list_rounds(run_id):
        _, up, down = naive_eval_traffic(given[rnd.round])
        assert (rnd.eval_bytes_up, rnd.eval_bytes_down) == (up, down)
        assert (up, down) == naive_eval_traffic(e for e in stored if e.round == rnd.round)[1:]
    updates = repo.list_updates(run_id)
    summaries = repo.site_summaries(run_id)
    assert [s.name for s in summaries] == list(names)
    for summary in summaries:
        mine = [e for evals in given.values() for e in evals if e.site == summary.name]
        assert (summary.evaluations, summary.eval_bytes_up, summary.eval_bytes_down) == (
            naive_eval_traffic(mine)
        )
        # Evaluations do not change the update totals.
        assert_summary_matches(summary, naive_summary(u for u in updates if u.site == summary.name))
    assert (summaries[-1].evaluations, summaries[-1].eval_bytes_up) == (0, 0)
    assert summaries[0].eval_bytes_down == 2**40 + 3


# ---------------------------------------------------------------------------- virtual time
def test_virtual_time_round_trips_on_runs_rounds_and_updates(repo: LedgerRepository) -> None:
    run_id = make_run(repo, network="configs/networks/mobile.toml")
    repo.add_site(run_id, name="london", node_id=1)
    simulated = update(
        "london",
        virtual_dispatched_at=12.125,
        virtual_arrived_at=30.5,
        virtual_compute_seconds=15.25,
        transfer_seconds=3.125,
    )
    dropped = update("london", "dropped", arrived_at=None, virtual_dispatched_at=13.0)
    record(
        repo,
        run_id,
        1,
        [simulated, dropped],
        virtual_started_at=0.0,
        virtual_finished_at=30.5,
    )
    repo.finish_run(run_id, status="finished", finished_at=T0 + 9, simulated_seconds=1234.5)

    run = repo.get_run(run_id)
    assert (run.network, run.simulated_seconds) == ("configs/networks/mobile.toml", 1234.5)
    assert repo.list_runs()[0].network == "configs/networks/mobile.toml"
    [rnd] = repo.list_rounds(run_id)
    assert (rnd.virtual_started_at, rnd.virtual_finished_at) == (0.0, 30.5)
    first, second = repo.list_updates(run_id)
    assert (first.virtual_dispatched_at, first.virtual_arrived_at) == (12.125, 30.5)
    assert (first.virtual_compute_seconds, first.transfer_seconds) == (15.25, 3.125)
    assert (second.virtual_dispatched_at, second.virtual_arrived_at) == (13.0, None)
    assert (second.virtual_compute_seconds, second.transfer_seconds) == (None, None)
    data = json.loads(json.dumps(run.to_dict()))
    assert (data["network"], data["simulated_seconds"]) == ("configs/networks/mobile.toml", 1234.5)


def test_wall_clock_runs_have_no_virtual_time(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")])
    repo.finish_run(run_id, status="finished", finished_at=T0 + 9)

    run = repo.get_run(run_id)
    assert (run.network, run.simulated_seconds) == (None, None)
    [rnd] = repo.list_rounds(run_id)
    assert (rnd.virtual_started_at, rnd.virtual_finished_at) == (None, None)
    [stored] = repo.list_updates(run_id)
    assert (stored.virtual_dispatched_at, stored.virtual_arrived_at) == (None, None)
    assert (stored.virtual_compute_seconds, stored.transfer_seconds) == (None, None)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(-0.5, "got -0.5"), (math.nan, "got nan"), (math.inf, "got inf"), ("1", "got str '1'")],
)
def test_virtual_times_of_runs_and_rounds_are_validated(
    repo: LedgerRepository, value: Any, shown: str
) -> None:
    allowed = "must be None or a finite number of seconds >= 0, "
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    for name in ("virtual_started_at", "virtual_finished_at"):
        with pytest.raises(StorageError, match=f"{name} {allowed}{shown}"):
            record(repo, run_id, 1, [update("a")], **{name: value})
    with pytest.raises(StorageError, match=f"simulated_seconds {allowed}{shown}"):
        repo.finish_run(run_id, status="finished", finished_at=T0 + 1, simulated_seconds=value)
    assert repo.list_rounds(run_id) == []
    assert repo.get_run(run_id).status == "running"


def test_virtual_round_times_must_be_in_order_and_network_a_name(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    with pytest.raises(StorageError, match="virtual_finished_at 1.0 is before virtual_started_at"):
        record(repo, run_id, 1, [], virtual_started_at=2.0, virtual_finished_at=1.0)
    with pytest.raises(StorageError, match="network must be a non-empty string"):
        make_run(repo, network="")
    with pytest.raises(StorageError, match="network must be at most 255 characters"):
        make_run(repo, network="x" * 256)
    with pytest.raises(StorageError, match="network must be a non-empty string"):
        make_run(repo, network=3)
    assert repo.list_rounds(run_id) == []
    assert len(repo.list_runs()) == 1


# One site's updates for the golden summaries, sorted by dispatch time (seconds from 0):
# (dispatched, arrived, status, staleness, compute, transfer). D is recorded after E, so the
# summary must order by dispatch time, not by recording order.
GOLDEN: dict[str, tuple[float, float | None, UpdateStatus, int, float | None, float | None]] = {
    "A": (0.0, 3.0, "applied", 0, 2.0, 1.0),
    "B": (4.0, 9.0, "applied", 1, 3.5, 1.5),
    "C": (10.0, None, "dropped", 5, None, None),  # nothing arrived: no gap from it
    "D": (12.5, 14.0, "applied", 2, 1.0, 0.5),
    "E": (13.0, 16.0, "rejected", 7, 0.5, 0.25),  # dispatched before D arrived: overlap
    "F": (20.0, 21.0, "applied", 1, 0.25, None),  # the last: no next dispatch
}
GOLDEN_ROUNDS = (("A",), ("B", "C"), ("E", "D"), ("F",))
# Waiting: A->B 4-3=1, B->C 10-9=1, C none, D->E 13-14<0 so 0, E->F 20-16=4, F none: 6.
GOLDEN_WAITING = 6.0
# Busy: A 3, B 5, D 1.5, E 3, F 1.
GOLDEN_BUSY = 13.5
# Applied only (A, B, D, F): staleness 0, 1, 2, 1; over all six the mean would be 16/6.
GOLDEN_COUNTS = {0: 1, 1: 2, 2: 1}


def _golden_update(key: str, *, virtual: bool, **overrides: Any) -> UpdateInput:
    dispatched, arrived, status, staleness, compute, transfer = GOLDEN[key]
    if virtual:
        times: dict[str, Any] = {
            "virtual_dispatched_at": dispatched,
            "virtual_arrived_at": arrived,
            "virtual_compute_seconds": compute,
            "transfer_seconds": transfer,
        }
    else:
        times = {
            "dispatched_at": T0 + dispatched,
            "arrived_at": None if arrived is None else T0 + arrived,
        }
    return update("london", status, staleness=staleness, **{**times, **overrides})


def test_site_summary_golden_case_on_the_virtual_clock(repo: LedgerRepository) -> None:
    run_id = make_run(repo, network="lan")
    for name in ("london", "tokyo", "idle"):
        repo.add_site(run_id, name=name, node_id=len(name))
    # tokyo: 10 applied updates back to back (1 s busy, 1 s waiting between), staleness eight
    # times 0, then 1 and 9, so the 9th of 10 (the nearest-rank p90) is 1 while the max is 9.
    tokyo = [
        update(
            "tokyo",
            staleness=staleness,
            virtual_dispatched_at=2.0 * k,
            virtual_arrived_at=2.0 * k + 1,
        )
        for k, staleness in enumerate([0] * 8 + [1, 9])
    ]
    for step, keys in enumerate(GOLDEN_ROUNDS, start=1):
        # Wall times: every update dispatched at T0+1 and arrived at T0+2 (the helper's
        # defaults), which would give other answers if the wall clock were used.
        batch = [_golden_update(key, virtual=True) for key in keys]
        record(repo, run_id, step, batch + tokyo[5 * (step - 1) : 5 * step])
    # Buffered with wall times only: left off the virtual clock, and not applied.
    record(repo, run_id, 5, [update("london", "buffered", staleness=3)])

    london, tokyo_summary, idle = repo.site_summaries(run_id)

    assert london.waiting_clock == tokyo_summary.waiting_clock == idle.waiting_clock == "virtual"
    assert (london.updates, london.applied) == (7, 4)
    assert london.staleness_counts == GOLDEN_COUNTS
    assert (london.mean_staleness, london.max_staleness, london.p90_staleness) == (1.0, 2, 2)
    assert london.waiting_seconds == pytest.approx(GOLDEN_WAITING)
    assert london.busy_seconds == pytest.approx(GOLDEN_BUSY)
    assert london.virtual_compute_seconds == pytest.approx(7.25)
    assert london.transfer_seconds == pytest.approx(3.25)
    assert london.to_dict()["staleness_counts"] == [[0, 1], [1, 2], [2, 1]]

    assert tokyo_summary.staleness_counts == {0: 8, 1: 1, 9: 1}
    assert (tokyo_summary.max_staleness, tokyo_summary.p90_staleness) == (9, 1)
    assert tokyo_summary.mean_staleness == pytest.approx(1.0)
    assert (tokyo_summary.waiting_seconds, tokyo_summary.busy_seconds) == (9.0, 10.0)
    assert (tokyo_summary.virtual_compute_seconds, tokyo_summary.transfer_seconds) == (None, None)

    assert (idle.updates, idle.staleness_counts, idle.p90_staleness) == (0, {}, None)
    assert (idle.waiting_seconds, idle.busy_seconds) == (0.0, 0.0)


def test_site_summary_golden_case_on_the_wall_clock(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="london", node_id=1)
    for step, keys in enumerate(GOLDEN_ROUNDS, start=1):
        record(repo, run_id, step, [_golden_update(key, virtual=False) for key in keys])

    [london] = repo.site_summaries(run_id)

    assert london.waiting_clock == "wall"
    assert london.waiting_seconds == pytest.approx(GOLDEN_WAITING, abs=1e-6)
    assert london.busy_seconds == pytest.approx(GOLDEN_BUSY, abs=1e-6)
    assert london.staleness_counts == GOLDEN_COUNTS
    assert (london.mean_staleness, london.max_staleness, london.p90_staleness) == (1.0, 2, 2)
    assert (london.virtual_compute_seconds, london.transfer_seconds) == (None, None)


def test_staleness_is_summarised_over_applied_updates_only(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(
        repo, run_id, 1, [update("a", status, staleness=4) for status in ("dropped", "rejected")]
    )

    [summary] = repo.site_summaries(run_id)

    assert (summary.updates, summary.applied) == (2, 0)
    assert (summary.mean_staleness, summary.max_staleness, summary.p90_staleness) == (
        None,
        None,
        None,
    )
    assert summary.staleness_counts == {}


# ---------------------------------------------------------------------------- delayed updates
def test_delayed_update_fields_round_trip(repo: LedgerRepository) -> None:
    run_id = make_run(repo, strategy="delayed")
    repo.add_site(run_id, name="london", node_id=1)
    repo.add_site(run_id, name="tokyo", node_id=2)
    # london started period 4 in round 3 from average 2 (delay 1); tokyo's dropped update was
    # local SGD (delay 0) on average 3; the rejected one has no delayed fields at all.
    ahead = update("london", dispatched_round=3, period=4, average_applied=2, delay=1)
    local = update("tokyo", "dropped", arrived_at=None, period=4, average_applied=3, delay=0)
    plain = update("tokyo", "rejected", reason="non-finite")
    largest = update("london", period=2**31 - 1, average_applied=2**31 - 1, delay=2**31 - 1)
    record(repo, run_id, 4, [ahead, local, plain, largest])

    stored = repo.list_updates(run_id)
    assert [(u.dispatched_round, u.period, u.average_applied, u.delay) for u in stored] == [
        (3, 4, 2, 1),
        (1, 4, 3, 0),
        (1, None, None, None),
        (1, 2**31 - 1, 2**31 - 1, 2**31 - 1),
    ]
    data = json.loads(json.dumps(stored[0].to_dict()))
    assert (data["period"], data["average_applied"], data["delay"]) == (4, 2, 1)
    assert json.loads(json.dumps(stored[2].to_dict()))["delay"] is None


def test_update_fragments_round_trip(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="london", node_id=1)
    rows = [
        update("london", fragment=0),
        update("london", "dropped", arrived_at=None, fragment=2),
        update("london", fragment=2**31 - 1),
        update("london"),  # the whole model
    ]
    record(repo, run_id, 1, rows)
    stored = repo.list_updates(run_id)
    assert [u.fragment for u in stored] == [0, 2, 2**31 - 1, None]
    assert [json.loads(json.dumps(u.to_dict()))["fragment"] for u in stored] == [
        0,
        2,
        2**31 - 1,
        None,
    ]


def test_updates_of_other_strategies_have_no_delay(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a"), update("a", "dropped")])

    assert {(u.period, u.average_applied, u.delay) for u in repo.list_updates(run_id)} == {
        (None, None, None)
    }
    [summary] = repo.site_summaries(run_id)
    assert summary.mean_delay is None


def test_mean_delay_is_over_applied_updates_that_have_a_delay(repo: LedgerRepository) -> None:
    run_id = make_run(repo, strategy="delayed")
    for name in ("london", "tokyo", "ohio", "idle"):
        repo.add_site(run_id, name=name, node_id=len(name))

    def delayed(site: str, status: UpdateStatus, delay: int | None) -> UpdateInput:
        # Always from average 4, sent for the period that makes delay = period - 1 - 4.
        period = None if delay is None else 5 + delay
        average = None if delay is None else 4
        return update(site, status, period=period, average_applied=average, delay=delay)

    # london: applied delays 0, 2, 2 and one applied update without a delay; the dropped,
    # rejected and buffered ones (9, 7, 5) are left out. Mean (0 + 2 + 2) / 3 = 4/3; counting
    # the missing delay as 0 would give 1, counting every status 25/6.
    record(
        repo,
        run_id,
        1,
        [
            delayed("london", "applied", 0),
            delayed("london", "dropped", 9),
            delayed("tokyo", "rejected", 3),
            delayed("ohio", "applied", None),
        ],
    )
    record(
        repo,
        run_id,
        2,
        [
            delayed("london", "applied", 2),
            delayed("london", "rejected", 7),
            delayed("london", "applied", None),
            delayed("london", "buffered", 5),
            delayed("london", "applied", 2),
        ],
    )

    london, tokyo, ohio, idle = repo.site_summaries(run_id)

    assert (london.updates, london.applied) == (7, 4)
    assert london.mean_delay == pytest.approx(4 / 3)
    assert tokyo.mean_delay is None  # its only delay is on a rejected update
    assert ohio.mean_delay is None  # applied, but without a delay
    assert (idle.updates, idle.mean_delay) == (0, None)
    assert json.loads(json.dumps(london.to_dict()))["mean_delay"] == pytest.approx(4 / 3)


# ---------------------------------------------------------------------------- errors
def test_a_missing_run_is_not_found_everywhere(repo: LedgerRepository) -> None:
    calls = {
        "get_run": lambda: repo.get_run(42),
        "finish_run": lambda: repo.finish_run(42, status="finished"),
        "add_site": lambda: repo.add_site(42, name="a", node_id=1),
        "list_sites": lambda: repo.list_sites(42),
        "record_round": lambda: record(repo, 42, 1, []),
        "list_rounds": lambda: repo.list_rounds(42),
        "list_updates": lambda: repo.list_updates(42),
        "list_evaluations": lambda: repo.list_evaluations(42),
        "site_summaries": lambda: repo.site_summaries(42),
        "list_checkpoints": lambda: repo.list_checkpoints(42),
        "latest_checkpoint": lambda: repo.latest_checkpoint(42),
        "keep_checkpoint": lambda: repo.keep_checkpoint(42, 1),
        "delete_checkpoint": lambda: repo.delete_checkpoint(42, 1),
        "add_event": lambda: repo.add_event(42, "resumed"),
        "list_events": lambda: repo.list_events(42),
        "reopen_run": lambda: repo.reopen_run(42, "host:1"),
        "add_traffic": lambda: repo.add_traffic(42, [traffic("a")]),
        "list_traffic": lambda: repo.list_traffic(42),
        "huge id": lambda: repo.get_run(2**40),
    }
    for name, call in calls.items():
        with pytest.raises(
            NotFoundError, match="does not exist; `flplatform history runs`"
        ) as info:
            call()
        assert repo.url in info.value.reason, name


def test_run_inputs_are_validated(repo: LedgerRepository) -> None:
    with pytest.raises(StorageError, match="run name"):
        make_run(repo, name="")
    with pytest.raises(StorageError, match="run config"):
        make_run(repo, config={"ids": {1, 2}})
    with pytest.raises(StorageError, match="seed"):
        make_run(repo, seed=2**63)
    with pytest.raises(StorageError, match="num_rounds_planned"):
        make_run(repo, num_rounds_planned=-1)
    with pytest.raises(StorageError, match="run id must be an integer"):
        repo.get_run("1")  # type: ignore[arg-type]
    assert repo.list_runs() == []


def test_a_closed_repository_raises_storage_error(ledger_url: str) -> None:
    repo = LedgerRepository.open(ledger_url)
    repo.close()
    with pytest.raises(StorageError, match="closed"):
        repo.list_runs()


# ---------------------------------------------------------------------------- durability
def test_rows_survive_the_writer_dying_without_finish_run(ledger_url: str) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from storage import LedgerRepository, UpdateInput
        repo = LedgerRepository.open({ledger_url!r})
        run = repo.create_run(name="doomed", strategy="fedavg", seed=0, config={{}},
                              num_rounds_planned=10, tag="doomed")
        repo.add_site(run, name="a", node_id=1)
        for step in (1, 2):
            repo.record_round(run, round=step, model_version=step, started_at=1.0 * step,
                              finished_at=1.0 * step + 0.5, metrics={{"accuracy": step / 10}},
                              train_loss=None, updates=[UpdateInput(site="a",
                              dispatched_round=step, version_trained_on=step - 1, staleness=0,
                              bytes_up=1, bytes_down=2, status="applied", dispatched_at=1.0)])
        os._exit(3)  # no close(), no finish_run(), no interpreter clean-up
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr

    with LedgerRepository.open(ledger_url) as repo:
        run = repo.find_run_by_tag("doomed")
        assert run is not None
        assert (run.status, run.rounds_completed, run.last_metrics) == (
            "running",
            2,
            {"accuracy": 0.2},
        )
        assert len(repo.list_updates(run.id)) == 2


def test_deleting_a_run_cascades_to_its_rows(repo: LedgerRepository) -> None:
    keep, drop = make_run(repo), make_run(repo)
    for run_id in (keep, drop):
        repo.add_site(run_id, name="a", node_id=1)
        record(repo, run_id, 1, [update("a")], evaluations=[evaluation("a")])

    # No repository method deletes (yet); the schema's ON DELETE CASCADE must hold regardless,
    # which on SQLite needs the foreign_keys pragma on every connection.
    with repo._engine.begin() as connection:
        connection.execute(text("DELETE FROM runs WHERE id = :id"), {"id": drop})

    assert (count_rows(repo, "sites"), count_rows(repo, "rounds"), count_rows(repo, "updates")) == (
        1,
        1,
        1,
    )
    assert count_rows(repo, "evaluations") == 1
    assert len(repo.list_updates(keep)) == 1
    assert len(repo.list_evaluations(keep)) == 1

    # Deleting a site takes its evaluations (and updates) with it.
    with repo._engine.begin() as connection:
        connection.execute(text("DELETE FROM sites WHERE run_id = :id"), {"id": keep})
    assert (count_rows(repo, "updates"), count_rows(repo, "evaluations")) == (0, 0)


def test_records_serialise_to_json(repo: LedgerRepository) -> None:
    run_id = make_run(repo, tag="j")
    repo.add_site(run_id, name="a", node_id=UINT64_MAX, profile={"x": [1, 2]})
    record(
        repo,
        run_id,
        1,
        [update("a")],
        evaluations=[evaluation("a")],
        checkpoint=CheckpointInput(path="/c/round-000001.npz", size_bytes=10),
    )
    repo.add_event(run_id, "note", {"said": [1, "x"]})
    repo.add_traffic(run_id, [traffic("a")])
    repo.finish_run(run_id, status="finished", finished_at=T0 + 60)

    records: list[Any] = [
        repo.get_run(run_id),
        *repo.list_sites(run_id),
        *repo.list_rounds(run_id),
        *repo.list_updates(run_id),
        *repo.site_summaries(run_id),
        *repo.list_evaluations(run_id),
        *repo.list_checkpoints(run_id),
        *repo.list_events(run_id),
        *repo.list_traffic(run_id),
    ]
    for rec in records:
        data = json.loads(json.dumps(rec.to_dict()))
        assert set(data) == set(rec.__dataclass_fields__)
    run = records[0].to_dict()
    assert datetime.fromisoformat(run["finished_at"]) == utc(T0 + 60)
    assert records[1].to_dict()["node_id"] == UINT64_MAX
    assert {"eval_bytes_up": 30, "eval_bytes_down": 300}.items() <= records[2].to_dict().items()
    summary = records[4].to_dict()
    assert (summary["evaluations"], summary["eval_bytes_up"], summary["eval_bytes_down"]) == (
        1,
        30,
        300,
    )
    evaluated = records[5].to_dict()
    assert (evaluated["site"], evaluated["status"], evaluated["accuracy"]) == (
        "a",
        "evaluated",
        0.875,
    )
    assert datetime.fromisoformat(evaluated["arrived_at"]) == utc(T0 + 4)
    run["config"]["lr"] = 99  # a copy: the record itself is untouched
    assert records[0].config == {"lr": 0.1}


# ---------------------------------------------------------------------------- resume (0005)
def checkpoint(step: int, *, kept: bool = False, size: int = 1000) -> CheckpointInput:
    return CheckpointInput(path=f"/ckpt/run/round-{step:06d}.npz", size_bytes=size, kept=kept)


def test_a_round_and_its_checkpoint_are_committed_together(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")], model_version=3, checkpoint=checkpoint(1, kept=True))
    record(repo, run_id, 2, [update("a")], model_version=4)  # a round without one
    record(repo, run_id, 3, [update("a")], model_version=5, checkpoint=checkpoint(3, size=7))

    first, third = repo.list_checkpoints(run_id)
    assert isinstance(first, CheckpointRecord)
    assert (first.run_id, first.round, first.model_version, first.kept) == (run_id, 1, 3, True)
    assert (first.path, first.size_bytes) == ("/ckpt/run/round-000001.npz", 1000)
    assert (third.round, third.model_version, third.size_bytes, third.kept) == (3, 5, 7, False)
    assert first.created_at.tzinfo is not None
    assert repo.latest_checkpoint(run_id) == third
    assert repo.latest_checkpoint(make_run(repo)) is None


def test_a_round_already_recorded_takes_no_second_checkpoint(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")], checkpoint=checkpoint(1))

    with pytest.raises(StorageError, match="round 1 of run .* is already recorded"):
        record(repo, run_id, 1, [update("a")], checkpoint=checkpoint(1, size=5))

    [only] = repo.list_checkpoints(run_id)
    assert only.size_bytes == 1000
    assert count_rows(repo, "rounds") == 1


def test_a_round_that_fails_leaves_no_checkpoint_row(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="a", node_id=1)

    with pytest.raises(StorageError, match="which run .* does not have"):
        record(repo, run_id, 1, [update("ghost")], checkpoint=checkpoint(1))

    assert repo.list_checkpoints(run_id) == []
    assert repo.list_rounds(run_id) == []


def test_checkpoint_inputs_are_validated(repo: LedgerRepository) -> None:
    with pytest.raises(StorageError, match="checkpoint path"):
        CheckpointInput(path="", size_bytes=1)
    with pytest.raises(StorageError, match="checkpoint size"):
        CheckpointInput(path="/x", size_bytes=-1)
    with pytest.raises(StorageError, match="kept must be True or False"):
        CheckpointInput(path="/x", size_bytes=1, kept=1)  # type: ignore[arg-type]
    run_id = make_run(repo)
    with pytest.raises(StorageError, match="checkpoint must be a CheckpointInput"):
        record(repo, run_id, 1, [], checkpoint={"path": "/x"})
    assert repo.list_rounds(run_id) == []


def test_checkpoints_are_kept_and_deleted_by_round(repo: LedgerRepository) -> None:
    run_id, other = make_run(repo), make_run(repo)
    for step in (1, 2, 3):
        record(repo, run_id, step, [], checkpoint=checkpoint(step))
    record(repo, other, 2, [], checkpoint=checkpoint(2))

    kept = repo.keep_checkpoint(run_id, 2)
    gone = repo.delete_checkpoint(run_id, 1)

    assert (kept.round, kept.kept, gone.round) == (2, True, 1)
    assert [(c.round, c.kept) for c in repo.list_checkpoints(run_id)] == [(2, True), (3, False)]
    assert [c.round for c in repo.list_checkpoints(other)] == [2]  # another run's: untouched
    with pytest.raises(NotFoundError, match=r"no checkpoint of round 1; .* rounds 2, 3"):
        repo.delete_checkpoint(run_id, 1)
    with pytest.raises(NotFoundError, match="has no checkpoints"):
        repo.keep_checkpoint(make_run(repo), 1)


def test_events_are_listed_in_order_with_their_detail(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    first = repo.add_event(run_id, "resumed", {"from": "failed", "n": 2}, at=T0 + 5)
    repo.finish_run(run_id, status="finished", finished_at=T0 + 60)
    repo.add_event(run_id, "exported", at=T0 + 70)  # a finished run takes events too

    events = repo.list_events(run_id)
    assert [(e.id, e.kind, e.detail) for e in events] == [
        (first, "resumed", {"from": "failed", "n": 2}),
        (events[1].id, "exported", {}),
    ]
    assert [e.at for e in events] == [utc(T0 + 5), utc(T0 + 70)]
    assert repo.list_events(make_run(repo)) == []
    with pytest.raises(StorageError, match="event kind"):
        repo.add_event(run_id, "")
    with pytest.raises(StorageError, match="event kind must be at most 32"):
        repo.add_event(run_id, "x" * 33)
    with pytest.raises(StorageError, match="event detail"):
        repo.add_event(run_id, "k", {"ids": {1, 2}})


def test_create_run_records_its_owner(repo: LedgerRepository) -> None:
    assert repo.get_run(make_run(repo, owner="host-a:123")).owner == "host-a:123"
    assert repo.get_run(make_run(repo)).owner is None
    with pytest.raises(StorageError, match="owner"):
        make_run(repo, owner="")


@pytest.mark.parametrize("status", ["running", "failed"])
def test_reopen_run_resumes_a_run_that_died_and_records_the_event(
    repo: LedgerRepository, status: str
) -> None:
    run_id = make_run(repo, owner="old:1")
    repo.add_site(run_id, name="a", node_id=1)
    record(repo, run_id, 1, [update("a")], checkpoint=checkpoint(1))
    if status == "failed":
        repo.finish_run(
            run_id, status="failed", error="killed", finished_at=T0 + 30, simulated_seconds=2.0
        )

    reopened = repo.reopen_run(run_id, "new:2")

    assert (reopened.status, reopened.owner, reopened.error) == ("running", "new:2", None)
    assert (reopened.finished_at, reopened.wall_seconds, reopened.simulated_seconds) == (
        None,
        None,
        None,
    )
    assert reopened.rounds_completed == 1
    [event] = repo.list_events(run_id)
    assert event.kind == "resumed"
    assert event.detail == {
        "status": status,
        "error": "killed" if status == "failed" else None,
        "previous_owner": "old:1",
        "owner": "new:2",
    }
    # The run takes rounds again, but never a round twice.
    record(repo, run_id, 2, [update("a")], checkpoint=checkpoint(2))
    with pytest.raises(StorageError, match="already recorded"):
        record(repo, run_id, 1, [update("a")])
    assert [c.round for c in repo.list_checkpoints(run_id)] == [1, 2]


def test_reopen_run_refuses_a_finished_run(repo: LedgerRepository) -> None:
    run_id = make_run(repo, owner="old:1")
    repo.finish_run(run_id, status="finished", finished_at=T0 + 60)

    with pytest.raises(StorageError, match=f"run {run_id} finished; only a run that is running"):
        repo.reopen_run(run_id, "new:2")

    run = repo.get_run(run_id)
    assert (run.status, run.owner) == ("finished", "old:1")
    assert repo.list_events(run_id) == []
    with pytest.raises(StorageError, match="owner"):
        repo.reopen_run(make_run(repo), "")


def test_deleting_a_run_takes_its_checkpoints_and_events(repo: LedgerRepository) -> None:
    keep, drop = make_run(repo), make_run(repo)
    for run_id in (keep, drop):
        record(repo, run_id, 1, [], checkpoint=checkpoint(1))
        repo.add_event(run_id, "resumed")
    with repo._engine.begin() as connection:
        connection.execute(text("DELETE FROM runs WHERE id = :id"), {"id": drop})
    assert (count_rows(repo, "checkpoints"), count_rows(repo, "run_events")) == (1, 1)
    assert len(repo.list_checkpoints(keep)) == 1


# ---------------------------------------------------------------------------- traffic (0006)
def traffic(site: str = "a", kind: str = "query", **overrides: Any) -> TrafficInput:
    fields: dict[str, Any] = {
        "site": site,
        "kind": kind,
        "messages": 1,
        "bytes_up": 40,
        "bytes_down": 70,
    }
    fields.update(overrides)
    return TrafficInput(**fields)


def test_traffic_round_trips_every_field_in_recording_order(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    for name in ("london", "ohio"):
        repo.add_site(run_id, name=name, node_id=UINT64_MAX)
    repo.add_traffic(run_id, [traffic("london"), traffic("ohio", bytes_up=2**40)])
    repo.add_traffic(
        run_id, [traffic("ohio", "evaluate", messages=0, bytes_up=5, bytes_down=6)], round=3
    )

    stored = repo.list_traffic(run_id)
    assert [(t.site, t.round, t.kind, t.messages, t.bytes_up, t.bytes_down) for t in stored] == [
        ("london", None, "query", 1, 40, 70),
        ("ohio", None, "query", 1, 2**40, 70),
        ("ohio", 3, "evaluate", 0, 5, 6),
    ]
    assert all(t.run_id == run_id for t in stored)
    assert [t.site for t in repo.list_traffic(run_id, site="ohio")] == ["ohio", "ohio"]
    assert [t.kind for t in repo.list_traffic(run_id, kind=["evaluate"])] == ["evaluate"]
    with pytest.raises(NotFoundError, match="run 1 has no site 'tokyo'"):
        repo.list_traffic(run_id, site="tokyo")
    with pytest.raises(StorageError, match="unknown traffic kind 'train2'"):
        repo.list_traffic(run_id, kind="train2")


def test_traffic_is_validated_and_all_or_nothing(repo: LedgerRepository) -> None:
    run_id = make_run(repo)
    repo.add_site(run_id, name="london", node_id=1)
    for bad, match in (
        ({"kind": "system"}, "traffic field 'kind' is 'system'; allowed: train, evaluate, query"),
        ({"bytes_up": -1}, "traffic field 'bytes_up'"),
        ({"messages": 2**31}, "traffic field 'messages'"),
        ({"site": ""}, "traffic field 'site'"),
    ):
        with pytest.raises(StorageError, match=re.escape(match)):
            traffic(**{"site": "london", **bad})
    with pytest.raises(StorageError, match="traffic\\[0\\] must be an TrafficInput"):
        repo.add_traffic(run_id, [object()])  # type: ignore[list-item]
    with pytest.raises(StorageError, match="round must be >= 1"):
        repo.add_traffic(run_id, [traffic("london")], round=0)
    # A row naming a site the run does not have writes none of the batch.
    with pytest.raises(StorageError, match="traffic from site 'tokyo', which run 1 does not"):
        repo.add_traffic(run_id, [traffic("london"), traffic("tokyo")])
    assert repo.list_traffic(run_id) == []
    repo.finish_run(run_id, status="finished", finished_at=T0 + 1)
    with pytest.raises(StorageError, match="run 1 is finished"):
        repo.add_traffic(run_id, [traffic("london")])


def test_run_and_site_totals_are_every_row_s_bytes(repo: LedgerRepository) -> None:
    run_id, other = make_run(repo), make_run(repo)
    for name in ("london", "ohio", "idle"):
        repo.add_site(run_id, name=name, node_id=1)
    repo.add_site(other, name="london", node_id=1)
    repo.add_traffic(run_id, [traffic("london", bytes_up=1, bytes_down=2), traffic("ohio")])
    record(
        repo,
        run_id,
        1,
        [update("london", bytes_up=10, bytes_down=20), update("ohio", "dropped", bytes_up=0)],
        evaluations=[evaluation("london", bytes_up=3, bytes_down=4)],
    )
    repo.add_traffic(
        run_id,
        [traffic("ohio", "train", messages=0, bytes_up=2**40, bytes_down=5)],
        round=1,
    )
    record(repo, other, 1, [update("london", bytes_up=1000, bytes_down=1000)])
    repo.add_traffic(other, [traffic("london", bytes_up=9, bytes_down=9)])

    # Each run's totals are its own rows' (updates + evaluations + traffic), each way.
    run = repo.get_run(run_id)
    assert (run.bytes_up, run.bytes_down) == (
        1 + 40 + 10 + 0 + 3 + 2**40,
        2 + 70 + 20 + 200 + 4 + 5,
    )
    assert {r.id: (r.bytes_up, r.bytes_down) for r in repo.list_runs()}[other] == (1009, 1009)
    london, ohio, idle = repo.site_summaries(run_id)
    assert (london.queries, london.query_bytes_up, london.query_bytes_down) == (1, 1, 2)
    assert (london.total_bytes_up, london.total_bytes_down) == (1 + 10 + 3, 2 + 20 + 4)
    # A late reply (kind train) counts in the totals, not as a query.
    assert (ohio.queries, ohio.query_bytes_up, ohio.query_bytes_down) == (1, 40, 70)
    assert (ohio.total_bytes_up, ohio.total_bytes_down) == (40 + 0 + 2**40, 70 + 200 + 5)
    assert (idle.queries, idle.total_bytes_up, idle.total_bytes_down) == (0, 0, 0)
    # Per site and per run, the totals agree.
    summaries = repo.site_summaries(run_id)
    assert sum(s.total_bytes_up for s in summaries) == run.bytes_up
    assert sum(s.total_bytes_down for s in summaries) == run.bytes_down


def test_a_run_without_rows_has_no_bytes(repo: LedgerRepository) -> None:
    run = repo.get_run(make_run(repo))
    assert (run.bytes_up, run.bytes_down) == (0, 0)


def test_deleting_a_run_or_site_takes_its_traffic(repo: LedgerRepository) -> None:
    keep, drop = make_run(repo), make_run(repo)
    for run_id in (keep, drop):
        repo.add_site(run_id, name="a", node_id=1)
        repo.add_traffic(run_id, [traffic("a")])
    with repo._engine.begin() as connection:
        connection.execute(text("DELETE FROM runs WHERE id = :id"), {"id": drop})
    assert count_rows(repo, "traffic") == 1
    with repo._engine.begin() as connection:
        connection.execute(text("DELETE FROM sites WHERE run_id = :id"), {"id": keep})
    assert count_rows(repo, "traffic") == 0
