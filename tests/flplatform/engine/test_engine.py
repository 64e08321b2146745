"""The round engine's scheduling and accounting, with the real strategy and SQL ledger."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, astuple

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Message,
    MessageType,
    MetricRecord,
)

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import StepRefused
from flplatform.engine import APPLIED, DROPPED, REJECTED, Synchrony
from flplatform.engine.engine import REFUSED, RoundEngine
from flplatform.engine.guard import UpdateGuard
from flplatform.run.ledger import SqlLedger
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.engine import engine_for, wire_bytes
from tests.helpers.fleet_oracle import naive_delivery, naive_reply
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import failing, site, stepping

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})


def silent(name: str) -> callable:
    """Introduces itself, then never answers a training message."""
    talk = site(name)
    return lambda msg: talk(msg) if msg.metadata.message_type == MessageType.QUERY else None


def slow_first(talk: Callable[[Message], Message | None], kind: str, seconds: float = 0.6):
    """``talk``, but the first ``kind`` message is answered only after ``seconds``."""
    first: dict[str, float] = {}

    def behave(msg: Message) -> Message | None:
        if msg.metadata.message_type != kind:
            return talk(msg)
        first.setdefault(msg.metadata.message_id, time.monotonic())
        is_first = next(iter(first)) == msg.metadata.message_id
        if is_first and time.monotonic() - first[msg.metadata.message_id] < seconds:
            return None
        return talk(msg)

    return behave


def test_sync_round_applies_everything_and_records_exact_bytes(ledger) -> None:
    grid = ScriptedGrid(
        {
            1: site("a", value=1.0, examples=10, loss=1.0),
            2: site("b", value=4.0, examples=30, loss=0.0),
        }
    )
    result = engine_for(grid, ledger).run(MODEL, num_rounds=2)
    # Example-weighted: (10·1 + 30·4) / 40 = 3.25, both rounds from the same replies.
    np.testing.assert_allclose(record_to_arrays(result.arrays)["w"], 3.25)
    repo, run_id = ledger
    rounds = repo.list_rounds(run_id)
    assert [r.model_version for r in rounds] == [1, 2]
    # Example-weighted loss, and a loss of exactly 0.0 still counts: (10·1 + 30·0) / 40.
    assert rounds[0].train_loss == pytest.approx(0.25)
    updates = repo.list_updates(run_id)
    train_pushed = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    train_replies = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    # Every recorded size is what Flower's SuperLink counts for the very messages that
    # travelled: down, the message and the acknowledgement of its reply; up, the reply.
    assert sorted((u.bytes_up, u.bytes_down) for u in updates) == sorted(
        wire_bytes(train_pushed, train_replies)
    )
    assert all(
        m.metadata.group_id == str(int(m.content["config"]["model-version"])) for m in train_pushed
    )


def test_evaluation_traffic_is_recorded_per_site(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b")})
    engine_for(grid, ledger, fraction_evaluate=1.0).run(
        MODEL, num_rounds=2, federated_evaluation=True
    )
    repo, run_id = ledger
    evaluations = repo.list_evaluations(run_id)
    assert [(e.round, e.status) for e in evaluations] == [(1, "evaluated")] * 2 + [
        (2, "evaluated")
    ] * 2
    assert all(e.accuracy == 0.5 and e.num_examples == 5 for e in evaluations)
    pushed = [m for m in grid.pushed if m.metadata.message_type == MessageType.EVALUATE]
    replies = [m for m in grid.replies if m.metadata.message_type == MessageType.EVALUATE]
    assert sorted((e.bytes_up, e.bytes_down) for e in evaluations) == sorted(
        wire_bytes(pushed, replies)
    )
    rounds = repo.list_rounds(run_id)
    assert rounds[0].eval_bytes_down == sum(e.bytes_down for e in evaluations if e.round == 1)
    assert rounds[0].metrics[keys.SITE_ACCURACY] == pytest.approx(0.5)


def test_silent_site_is_dropped_and_gets_no_second_message(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: silent("ghost")})
    engine = engine_for(grid, ledger, round_timeout=0.2, fraction_evaluate=1.0)
    engine.run(MODEL, num_rounds=3, federated_evaluation=True)
    repo, run_id = ledger
    ghost = repo.list_updates(run_id, site="ghost")
    # One training message, dropped after the timeout; never a second (the grid asserts).
    assert [(u.status, u.round) for u in ghost] == [(DROPPED, 1)]
    assert "no reply within 0.2 s" in (ghost[0].reason or "")  # not "within 0 s"
    assert [r.num_applied for r in repo.list_rounds(run_id)] == [1, 1, 1]
    # The ghost is busy all along, so it is never asked to evaluate either.
    assert {e.site for e in repo.list_evaluations(run_id)} == {"a"}


@pytest.mark.parametrize("refusal", ["inmemory", "http"])
def test_refused_push_is_recorded_and_the_others_keep_their_ids(ledger, refusal) -> None:
    # The FIRST site is refused: the others must still be matched to their own messages.
    grid = ScriptedGrid({1: site("a"), 2: site("b"), 3: site("c")}, refuse={1}, refusal=refusal)
    engine_for(grid, ledger).run(MODEL, num_rounds=2)
    repo, run_id = ledger
    names = [s.name for s in repo.list_sites(run_id)]
    assert sorted(names) == ["b", "c", "node-1"]  # its query was refused too
    rows = {(u.site, u.round): u for u in repo.list_updates(run_id)}
    refused = rows[("node-1", 1)]
    assert (refused.status, refused.reason, refused.bytes_down) == (DROPPED, REFUSED, 0)
    assert rows[("b", 1)].status == rows[("c", 1)].status == APPLIED
    assert [r.num_applied for r in repo.list_rounds(run_id)] == [2, 2]


def test_oversize_push_refuses_the_whole_batch(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b")}, refuse={2}, refusal="oversize")
    engine_for(grid, ledger, required_sites=2).run(MODEL, num_rounds=1)
    repo, run_id = ledger
    assert {u.status for u in repo.list_updates(run_id)} == {DROPPED}
    assert repo.list_rounds(run_id)[0].model_version == 0


def test_more_sites_than_a_pull_chunk(ledger) -> None:
    grid = ScriptedGrid({n: site(f"s{n}") for n in range(1, 41)})
    engine = engine_for(grid, ledger, startup_timeout=2.0, fraction_evaluate=1.0)
    engine.run(MODEL, num_rounds=1, federated_evaluation=True)
    repo, run_id = ledger
    # Every site introduced itself and was evaluated, past the first chunk of replies.
    assert sorted(s.name for s in repo.list_sites(run_id)) == sorted(f"s{n}" for n in range(1, 41))
    assert len(repo.list_evaluations(run_id)) == 40
    assert repo.list_rounds(run_id)[0].num_applied == 40


def test_late_reply_frees_the_site_and_its_bytes_count(ledger) -> None:
    # The only site takes 0.6 s the first time, twice the round timeout. Round 1 drops
    # it; round 2 waits (without failing) until the late reply frees it, then uses it.
    grid = ScriptedGrid({1: slow_first(site("slow"), MessageType.TRAIN)})
    engine_for(grid, ledger, round_timeout=0.3).run(MODEL, num_rounds=2)
    repo, run_id = ledger
    rows = repo.list_updates(run_id)
    dropped, late, applied = rows
    assert (dropped.round, dropped.status, dropped.bytes_up) == (1, DROPPED, 0)
    assert "no reply within" in (dropped.reason or "") and dropped.bytes_down > 0
    assert (late.round, late.status) == (2, DROPPED) and "late" in (late.reason or "")
    # Only its reply's bytes: its message's delivery is the dropped row's.
    first_reply = next(r for r in grid.replies if r.metadata.message_type == MessageType.TRAIN)
    assert (late.bytes_up, late.bytes_down) == astuple(naive_reply(first_reply))
    assert (applied.round, applied.status) == (2, APPLIED)


def test_a_site_that_joins_mid_run_is_introduced_and_used(ledger) -> None:
    grid = ScriptedGrid({1: site("a")})
    engine = engine_for(grid, ledger)
    engine.on_round = lambda summary: grid.behaviours.setdefault(2, site("newcomer"))
    engine.run(MODEL, num_rounds=3)
    repo, run_id = ledger
    assert [s.name for s in repo.list_sites(run_id)] == ["a", "newcomer"]
    assert [r.num_applied for r in repo.list_rounds(run_id)] == [1, 2, 2]
    # Each site's query is its own traffic, at the step during which it joined.
    assert [(t.site, t.kind, t.messages, t.round) for t in repo.list_traffic(run_id)] == [
        ("a", "query", 1, None),
        ("newcomer", "query", 1, 2),
    ]


def test_every_byte_that_crossed_is_in_the_ledger(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b", value=2.0)})
    engine_for(grid, ledger, fraction_evaluate=1.0).run(
        MODEL, num_rounds=2, federated_evaluation=True
    )
    repo, run_id = ledger
    # Queries, training and evaluation messages, every one answered: the run's totals are
    # what Flower's SuperLink counts for all of them.
    assert len(grid.replies) == len(grid.pushed) == 2 + 2 * 2 + 2 * 2
    replies = [naive_reply(r) for r in grid.replies]
    run = repo.get_run(run_id)
    assert run.bytes_up == sum(r.up for r in replies)
    assert run.bytes_down == sum(naive_delivery(m) for m in grid.pushed) + sum(
        r.down for r in replies
    )
    # The site-information queries are their own kind of traffic, one row per site.
    queries = [m for m in grid.pushed if m.metadata.message_type == MessageType.QUERY]
    traffic = repo.list_traffic(run_id)
    assert [(t.site, t.kind, t.messages, t.round) for t in traffic] == [
        ("a", "query", 1, None),
        ("b", "query", 1, None),
    ]
    assert sorted((t.bytes_up, t.bytes_down) for t in traffic) == sorted(
        wire_bytes(queries, grid.replies)
    )
    summaries = {s.name: s for s in repo.site_summaries(run_id)}
    for t in traffic:
        summary = summaries[t.site]
        assert (summary.queries, summary.query_bytes_up, summary.query_bytes_down) == (
            1,
            t.bytes_up,
            t.bytes_down,
        )
    assert sum(s.total_bytes_up for s in summaries.values()) == run.bytes_up


def test_a_late_evaluation_reply_adds_its_bytes_as_traffic(ledger) -> None:
    # The only site answers its first evaluation after 0.6 s, twice the timeout: round 1
    # drops it; round 2 waits until the late reply frees the site, and counts its bytes.
    grid = ScriptedGrid({1: slow_first(site("slow"), MessageType.EVALUATE)})
    engine_for(grid, ledger, round_timeout=0.3, fraction_evaluate=1.0).run(
        MODEL, num_rounds=2, federated_evaluation=True
    )
    repo, run_id = ledger
    dropped, answered = repo.list_evaluations(run_id)
    assert (dropped.round, dropped.status, dropped.bytes_up) == (1, DROPPED, 0)
    assert (answered.round, answered.status) == (2, "evaluated")
    late = next(r for r in grid.replies if r.metadata.message_type == MessageType.EVALUATE)
    query, evaluate = repo.list_traffic(run_id)
    assert query.kind == "query"
    assert (evaluate.site, evaluate.kind, evaluate.messages, evaluate.round) == (
        "slow",
        "evaluate",
        0,
        2,
    )
    assert (evaluate.bytes_up, evaluate.bytes_down) == astuple(naive_reply(late))


def test_a_round_with_nothing_applied_keeps_the_model(ledger) -> None:
    grid = ScriptedGrid({1: site("a", examples=-1), 2: failing("b")})
    result = engine_for(grid, ledger).run(MODEL, num_rounds=2)
    np.testing.assert_array_equal(record_to_arrays(result.arrays)["w"], 0.0)
    repo, run_id = ledger
    assert [r.model_version for r in repo.list_rounds(run_id)] == [0, 0]
    statuses = {(u.site, u.status) for u in repo.list_updates(run_id)}
    assert statuses == {("a", REJECTED), ("b", DROPPED)}
    assert "out of memory" in (repo.list_updates(run_id, site="b")[0].reason or "")


def test_garbage_a_site_reports_about_itself_cannot_end_the_run(ledger) -> None:
    nasty = {"partition-id": -1, "num-examples": -7, keys.SITE_NAME: "x\x00 y/../z"}
    grid = ScriptedGrid(
        {
            1: site("ignored", info=nasty, metrics={"compute-seconds": -1.0}),
            2: site("b", loss=float("nan")),
        }
    )
    engine_for(grid, ledger).run(MODEL, num_rounds=1)
    repo, run_id = ledger
    sites = {s.name: s for s in repo.list_sites(run_id)}
    assert set(sites) == {"x_y_.._z", "b"}
    assert sites["x_y_.._z"].partition_id is None and sites["x_y_.._z"].num_examples is None
    updates = {u.site: u for u in repo.list_updates(run_id)}
    assert updates["x_y_.._z"].status == APPLIED and updates["x_y_.._z"].compute_seconds is None
    assert updates["b"].train_loss is None


def test_each_arrival_can_be_its_own_step_with_staleness(ledger) -> None:
    # Four replies land in one pull; a K = 1 policy must still take one per step, and the
    # ones left over arrive stale, each measured against the model it was trained on.
    grid = ScriptedGrid({n: site(f"s{n}", value=float(n)) for n in range(1, 5)}, delay_pulls=1)
    engine_for(grid, ledger, policy=Synchrony("async")).run(MODEL, num_rounds=4)
    repo, run_id = ledger
    rounds = repo.list_rounds(run_id)
    assert [r.num_applied for r in rounds] == [1, 1, 1, 1]
    assert [r.model_version for r in rounds] == [1, 2, 3, 4]
    first_wave = [u for u in repo.list_updates(run_id) if u.version_trained_on == 0]
    assert sorted(u.staleness for u in first_wave) == [0, 1, 2, 3]


def test_update_outcome_fields_match_the_ledger_input() -> None:
    # The engine's rows and storage's input are adapted field by field (flplatform/run/ledger.py).
    from flplatform.engine import UpdateOutcome
    from storage import UpdateInput

    outcome = UpdateOutcome(
        site="a",
        dispatched_round=1,
        version_trained_on=0,
        staleness=0,
        bytes_up=1,
        bytes_down=2,
        status="applied",
        dispatched_at=time.time(),
    )
    assert UpdateInput(**asdict(outcome)).site == "a"


def test_a_late_evaluation_reply_is_not_recorded_as_a_training_update(ledger) -> None:
    # The site answers its first evaluation message only after the round timeout: the
    # evaluation row says dropped, and the late reply must not appear as a training row.
    talk = site("slow-eval")
    first_eval: dict[str, float] = {}

    def behave(msg: Message) -> Message | None:
        if msg.metadata.message_type == MessageType.EVALUATE:
            started = first_eval.setdefault(msg.metadata.message_id, time.monotonic())
            if len(first_eval) == 1 and time.monotonic() - started < 0.5:
                return None
        return talk(msg)

    grid = ScriptedGrid({1: behave})
    engine_for(grid, ledger, round_timeout=0.2, fraction_evaluate=1.0).run(
        MODEL, num_rounds=3, federated_evaluation=True
    )
    repo, run_id = ledger
    updates = repo.list_updates(run_id)
    assert all(u.dispatched_round >= 1 for u in updates)
    assert [u.status for u in updates if u.status != APPLIED] == []
    assert repo.list_evaluations(run_id)[0].status == DROPPED


class RefusesRoundTwo(LocalSGDAveraging):
    """Local-SGD whose step of round 2 would make the model unusable."""

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        self.server_round = server_round
        super().begin_aggregation(server_round, arrays)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.server_round == 2:
            raise StepRefused("the step would make array 'w' non-finite")
        return super().finish_aggregation()


def test_a_refused_steps_updates_do_not_become_the_guards_reference(ledger) -> None:
    grid = ScriptedGrid({n: stepping(f"s{n}", 0.1 * n) for n in range(1, 4)})
    repo, run_id = ledger
    engine = RoundEngine(
        grid,
        RefusesRoundTwo(),
        ledger=SqlLedger(repo, run_id),
        guard=UpdateGuard(),
        required_sites=3,
        poll_interval=0.0,
    )
    engine.run(MODEL, num_rounds=3)
    assert [r.num_applied for r in repo.list_rounds(run_id)] == [3, 0, 3]
    # the norms of rounds 1 and 3 (each site's step, 2-long: ‖0.1·n·1₄‖ = 0.2·n)
    windows = engine.guard.state_dict()["kinds"]["delta"]["rounds"]
    assert [sorted(round(n, 4) for n in w) for w in windows] == [[0.2, 0.4, 0.6]] * 2
