"""The update guard under ``flplatform.start``: hostile replies meet the real engine,
strategies and ledger (scripted sites; the real simulations are in tests/integration)."""

from __future__ import annotations

from collections.abc import Callable

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
from flplatform.core.arrays import record_to_arrays
from flplatform.engine import APPLIED, REJECTED
from flplatform.run.options import OPTIONS_ENV
from flplatform.run.start import start
from storage import LedgerRepository
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
# The guard off: what the server did before it existed.
NO_GUARD = dict(update_norm_ratio=0.0, reject_replays=False, update_min_cosine=-1.0)
Train = Callable[[int, np.ndarray], tuple[np.ndarray, int]]  # (round, sent) → (model, examples)


def honest(target: float | list[float]) -> Train:
    """Moves half-way to ``target`` each round (a different reply every round)."""
    goal = np.asarray(target, np.float32)
    return lambda server_round, sent: (sent + 0.5 * (goal - sent), 10)


def huge(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
    """Finite but huge weights, different every round (so not a replay)."""
    return np.full_like(sent, 1e30 * (1 + server_round)), 10


def scripted(name: str, train: Train, *, declared: int = 10) -> Behaviour:
    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: name, keys.NUM_EXAMPLES: declared})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        sent = record_to_arrays(msg.content.array_records[keys.ARRAYS])["w"]
        server_round = int(msg.content.config_records[keys.CONFIG][keys.SERVER_ROUND])
        model, examples = train(server_round, sent)
        arrays = ArrayRecord({"w": Array(np.asarray(model, np.float32))})
        metrics = MetricRecord({keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: 0.1})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)

    return behave


def federation(attacker: Train, *, declared: int = 10) -> ScriptedGrid:
    """Three honest sites pulling towards different targets, and an attacker."""
    return ScriptedGrid(
        {
            1: scripted("a", honest([1.0, 2.0, 1.0, 0.5])),
            2: scripted("b", honest([1.2, 1.0, 2.0, 1.0])),
            3: scripted("c", honest([0.8, 1.5, 1.0, 2.0])),
            4: scripted("evil", attacker, declared=declared),
        }
    )


@pytest.fixture
def db(sqlite_ledger: str) -> str:
    return sqlite_ledger


@pytest.fixture(autouse=True)
def no_cli_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPTIONS_ENV, raising=False)


def evil_rows(db: str) -> list[tuple[int, str, str | None]]:
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        return [
            (u.round, u.status, u.reason) for u in repo.list_updates(run.id) if u.site == "evil"
        ]


def honest_rows_applied(db: str) -> bool:
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        return all(u.status == APPLIED for u in repo.list_updates(run.id) if u.site != "evil")


def test_huge_finite_weights_are_rejected_and_the_model_survives(db: str) -> None:
    result = start(LocalSGDAveraging(), federation(huge), MODEL, num_rounds=4, ledger=db)
    w = record_to_arrays(result.arrays)["w"]
    assert np.isfinite(w).all() and np.abs(w).max() < 2.0  # the honest targets' range
    rows = evil_rows(db)
    assert [status for _, status, _ in rows] == [REJECTED] * 4
    assert all("x the recent median" in (r or "") and "not clipped" in (r or "") for *_, r in rows)
    assert honest_rows_applied(db)


def test_a_large_but_plausible_update_is_clipped_to_the_median(db: str) -> None:
    def large(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
        return sent + 30.0 * (1.5 - sent) * (1 + 0.01 * server_round), 10  # ~30x a step

    start(LocalSGDAveraging(), federation(large), MODEL, num_rounds=3, ledger=db)
    rows = evil_rows(db)
    assert [status for _, status, _ in rows] == [APPLIED] * 3
    assert all(
        "clipped: norm" in (r or "") and "scaled to the median" in (r or "") for *_, r in rows
    )


def test_without_the_guard_the_same_attack_destroys_the_model(db: str) -> None:
    result = start(
        LocalSGDAveraging(), federation(huge), MODEL, num_rounds=2, ledger=db, **NO_GUARD
    )
    assert np.abs(record_to_arrays(result.arrays)["w"]).max() > 1e28


def test_a_claim_of_a_trillion_examples_counts_as_the_declared_ten(db: str) -> None:
    def liar(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
        return sent + 0.5 * (5.0 - sent), 10**12  # pulls towards 5 with a huge weight

    result = start(LocalSGDAveraging(), federation(liar), MODEL, num_rounds=3, ledger=db)
    w = record_to_arrays(result.arrays)["w"]
    # Equal weights: the mean target is at most (2 + 2 + 2 + 5) / 4 = 2.75, not 5.
    assert np.all(w < 2.75)
    rows = evil_rows(db)
    assert all("claimed 1000000000000 examples but declared 10" in (r or "") for *_, r in rows)


def test_a_replayed_first_reply_is_rejected_every_round(db: str) -> None:
    first: dict[str, np.ndarray] = {}

    def replay(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
        first.setdefault("model", sent + 0.5 * (1.0 - sent))
        return first["model"], 10

    start(LocalSGDAveraging(), federation(replay), MODEL, num_rounds=3, ledger=db)
    rows = evil_rows(db)
    assert rows[0][1] == APPLIED
    assert [(s, r) for _, s, r in rows[1:]] == [
        (REJECTED, "identical to its reply of round 1: a replayed update")
    ] * 2


def test_a_sign_flipped_update_is_rejected_after_the_first_round(db: str) -> None:
    def flip(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
        goal = np.array([1.0, 1.5, 1.3, 1.2], np.float32)  # near the honest sites' mean
        return sent - 0.5 * (goal - sent), 10  # an honest step, negated

    # The direction check is off by default (see flplatform.engine.guard): turned on here.
    start(
        LocalSGDAveraging(),
        federation(flip),
        MODEL,
        num_rounds=4,
        ledger=db,
        update_min_cosine=-0.1,
    )
    rows = evil_rows(db)
    assert all(
        status == REJECTED and "direction: cosine -" in (reason or "")
        for _, status, reason in rows[1:]
    )
    assert honest_rows_applied(db)


def test_a_step_that_would_overflow_float32_is_not_taken(db: str) -> None:
    top = float(np.finfo(np.float32).max)

    def overflow(server_round: int, sent: np.ndarray) -> tuple[np.ndarray, int]:
        return np.full_like(sent, top), 10**6  # declared as much: it owns the average

    # No guard and server momentum 0.9: round 1 moves x to ≈ float32's maximum; from
    # round 2 on, x + 0.9·v would overflow. The step is refused and v left as it was.
    result = start(
        LocalSGDAveraging(beta=0.9),
        federation(overflow, declared=10**6),
        MODEL,
        num_rounds=3,
        ledger=db,
        max_failed_rounds=0,
        **NO_GUARD,
    )
    assert np.isfinite(record_to_arrays(result.arrays)["w"]).all()
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished"
        rounds = repo.list_rounds(run.id)
        assert [r.model_version for r in rounds] == [1, 1, 1]  # the model stays version 1
        refused = [u for u in repo.list_updates(run.id) if u.round > 1]
        assert refused and all(u.status == REJECTED for u in refused)
        assert all(
            "the round's step was not applied" in (u.reason or "")
            and "non-finite" in (u.reason or "")
            and "stays version 1" in (u.reason or "")
            for u in refused
        )


def test_a_huge_fetchsgd_sketch_is_rejected(db: str) -> None:
    """FetchSGD's replies are sketches; the guard judges the tables (kind 'sketch')."""
    from strategies.sketched_common import SKETCH
    from tests.helpers.delayed_sites import context, digits_site

    sites = {n: digits_site(n - 1, 4, context(n)) for n in range(1, 5)}
    inner = sites[4]

    def evil(msg: Message) -> Message:
        reply = inner(msg)
        if msg.metadata.message_type == MessageType.QUERY:
            info = reply.content.config_records[keys.SITE_INFO]
            info[keys.SITE_NAME] = "evil"
        elif msg.metadata.message_type == MessageType.TRAIN and reply.has_content():
            table = record_to_arrays(reply.content.array_records[keys.ARRAYS])[SKETCH]
            # its honest sketch blown up: finite in float32, and new every round
            reply.content[keys.ARRAYS] = ArrayRecord({SKETCH: Array(table * np.float32(1e30))})
        return reply

    sites[4] = evil
    from tests.helpers.sites import digits_model

    result = start(
        FetchSGD(k=200, seed=1),
        ScriptedGrid(sites),
        digits_model(),
        num_rounds=3,
        ledger=db,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
    )
    assert all(np.isfinite(a).all() for a in record_to_arrays(result.arrays).values())
    rows = evil_rows(db)
    assert len(rows) == 3  # 10^30 times the median: rejected (clipping is for plausible sizes)
    assert all(s == REJECTED and "x the recent median" in (r or "") for _, s, r in rows)
    assert honest_rows_applied(db)


def test_the_first_round_is_judged_as_it_arrives_not_held_until_it_closes(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flplatform.engine.guard import UpdateGuard

    held: list[int] = []
    ready = UpdateGuard.ready

    def watched(self: UpdateGuard) -> dict:
        decisions = ready(self)
        held.append(len(self._waiting))
        return decisions

    monkeypatch.setattr(UpdateGuard, "ready", watched)
    goals = [[1.0 + 0.1 * i, 2.0, 1.0, 0.5] for i in range(9)]
    sites = {i + 1: scripted(f"s{i}", honest(goal)) for i, goal in enumerate(goals)}
    sites[10] = scripted("evil", huge)
    result = start(LocalSGDAveraging(), ScriptedGrid(sites), MODEL, num_rounds=2, ledger=db)
    # at most min_reference − 1 = 2 updates wait at any time (was: all ten of round 1)
    assert held and max(held) <= 2
    assert [status for _, status, _ in evil_rows(db)] == [REJECTED] * 2
    assert honest_rows_applied(db)
    assert np.isfinite(record_to_arrays(result.arrays)["w"]).all()
