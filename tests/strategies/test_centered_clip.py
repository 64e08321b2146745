"""Centred clipping (strategies/centered_clip.py): the streamed rule against a naive one that
holds every round's updates, a hand-computed case, the bound it promises, and the same
numbers through LocalSGDAveraging's hooks on real Flower messages."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from flwr.app import (
    ConfigRecord,
    Message,
    MessageType,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, StepRefused
from flplatform.engine import RoundSummary
from flplatform.engine.engine import RoundEngine
from flplatform.engine.guard import GuardOptions, UpdateGuard
from strategies.aggregation import WeightedDeltaSum
from strategies.centered_clip import CenteredClip
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.delayed_sites import digits_site
from tests.helpers.replies import record, reply
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")


# ======================================================================= the naive rule
def naive_rounds(
    rounds: list[list[tuple[np.ndarray, float]]], radius: float, window: int = 3, least: int = 3
) -> list[np.ndarray]:
    """Each round's Δ̄, from the whole list of (Δ_n, w_n) per round, written as the paper's
    formula: c + Σ w α (Δ − c) / Σ w, α = min(1, τ/‖Δ − c‖), τ = radius × the median of the
    distances of the last ``window`` rounds up to this update (none clipped below
    ``least`` of them), c the last Δ̄ (0 at first)."""
    center = np.zeros_like(rounds[0][0][0], dtype=np.float64)
    history: list[list[float]] = []
    means = []
    for updates in rounds:
        mine: list[float] = []
        total, weights = np.zeros_like(center), 0.0
        for delta, weight in updates:
            distance = float(np.linalg.norm(np.asarray(delta, np.float64) - center))
            known = [d for past in history[-(window - 1) :] for d in past] + mine + [distance]
            alpha = 1.0
            if len(known) >= least:
                tau = radius * float(np.median(known))
                alpha = min(1.0, tau / distance) if distance > 0 else 1.0
            mine.append(distance)
            total += weight * alpha * (np.asarray(delta, np.float64) - center)
            weights += weight
        history.append(mine)
        center = center + total / weights
        means.append(center)
    return means


def streamed_rounds(
    rounds: list[list[tuple[np.ndarray, float]]],
    radius: float = 1.0,
    *,
    clip: CenteredClip | None = None,
) -> list[np.ndarray]:
    """Each round's Δ̄ as the strategy forms it: updates clipped as they arrive, one sum."""
    clip = clip or CenteredClip(radius)
    means = []
    for updates in rounds:
        acc = WeightedDeltaSum()
        for delta, weight in updates:
            offset = {"x": np.array(delta, dtype=np.float64)}
            acc.add(offset, weight, scale=clip.clip(offset), spent=True)
        mean = clip.recentre(acc.mean(spent=True))
        clip.propose(mean)
        clip.end_round(stepped=True)
        means.append(mean["x"].copy())
    return means


def test_a_hand_computed_case() -> None:
    # Round 1, c = 0: distances 2, 2, 50. The first two come before three distances are
    # known (not clipped); the third is judged against the median of (2, 2, 50) = 2:
    # α = 2/50, so (30, 40) counts as (1.2, 1.6). Δ̄₁ = ((2,0) + (0,2) + (1.2,1.6))/3.
    first = [
        (np.array([2.0, 0.0]), 1.0),
        (np.array([0.0, 2.0]), 1.0),
        (np.array([30.0, 40.0]), 1.0),
    ]
    mean1 = np.array([3.2, 3.6]) / 3
    # Round 2, c = Δ̄₁: offsets (1, 0), (0, −1), (−100, 0) at distances 1, 1, 100. The
    # medians so far: (2,2,50,1) → 2 and (2,2,50,1,1,100) → 2: the first two stand inside
    # τ = 2, the third counts as (−2, 0). Δ̄₂ = c + ((1,0) + (0,−1) + (−2,0))/3.
    second = [
        (mean1 + [1.0, 0.0], 1.0),
        (mean1 + [0.0, -1.0], 1.0),
        (mean1 + [-100.0, 0.0], 1.0),
    ]
    mean2 = mean1 + np.array([-1.0, -1.0]) / 3
    got = streamed_rounds([first, second], radius=1.0)
    np.testing.assert_allclose(got[0], mean1, rtol=1e-12)
    np.testing.assert_allclose(got[1], mean2, rtol=1e-12)
    np.testing.assert_allclose(naive_rounds([first, second], radius=1.0)[1], mean2, rtol=1e-12)


finite = st.floats(-1e3, 1e3, allow_nan=False, width=64)
vectors = arrays(np.float64, 4, elements=finite)
weights = st.floats(0.5, 100.0)


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.tuples(vectors, weights), min_size=1, max_size=6), min_size=1, max_size=5
    ),
    radius=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_streamed_equals_the_naive_rule(
    rounds: list[list[tuple[np.ndarray, float]]], radius: float
) -> None:
    for got, want in zip(
        streamed_rounds(rounds, radius), naive_rounds(rounds, radius), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    honest=st.lists(vectors, min_size=4, max_size=6),
    hostile=vectors,
    factor=st.sampled_from([-10.0, 5.0, 1e6]),
)
def test_one_update_moves_the_mean_no_further_than_the_radius_allows(
    honest: list[np.ndarray], hostile: np.ndarray, factor: float
) -> None:
    # After a first round, whatever the last update holds, Δ̄ is within w·τ/Σw of where the
    # others alone (with its weight) would put it: its offset counts at most τ long.
    first = [(h, 1.0) for h in honest]
    clip = CenteredClip(1.0)
    streamed_rounds([first], clip=clip)
    center = clip.center["x"].copy()
    second = [(h + 0.1, 1.0) for h in honest]
    acc = WeightedDeltaSum()
    for delta, w in second:
        offset = {"x": delta.astype(np.float64)}
        acc.add(offset, w, scale=clip.clip(offset), spent=True)
    before = {"x": acc.sums["x"].copy()}
    bad = {"x": hostile * factor}
    alpha = clip.clip(bad)
    tau = clip.reference()  # its own distance counted: one rank of the median at most
    assert tau is not None
    assert np.linalg.norm(alpha * bad["x"]) <= tau * (1 + 1e-9)
    acc.add(bad, 1.0, scale=alpha, spent=True)
    others = center + before["x"] / acc.total_weight
    mean = clip.recentre(acc.mean(spent=True))["x"]
    assert np.linalg.norm(mean - others) <= tau / acc.total_weight * (1 + 1e-9) + 1e-12


def test_a_step_not_taken_leaves_the_centre() -> None:
    clip = CenteredClip(1.0)
    streamed_rounds([[(np.ones(3), 1.0)]], clip=clip)
    kept = clip.center["x"].copy()
    clip.propose({"x": np.full(3, 7.0)})
    clip.end_round(stepped=False)
    np.testing.assert_array_equal(clip.center["x"], kept)
    assert list(clip.past) == [[math.sqrt(3)]]  # a round without updates leaves the window


# ================================================================ through the strategy
def test_the_strategy_forms_the_naive_rule_s_models_with_weights_and_guard_scales() -> None:
    rng = np.random.default_rng(3)
    model = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    strategy = LocalSGDAveraging(aggregator="centered-clip", clip_radius=1.5)
    current = record(**model)
    flat_rounds: list[list[tuple[np.ndarray, float]]] = []
    x = np.zeros(9)
    for server_round in (1, 2, 3, 4):
        strategy.begin_aggregation(server_round, current)
        updates = []
        for site in range(5):
            # one site far out in every round: its update 40× the others'
            spread = 40.0 if site == 4 else 1.0
            trained = {
                k: (v + spread * rng.normal(size=v.shape)).astype(np.float32)
                for k, v in record_to_arrays(current).items()
            }
            examples, scale = 10 + site, (0.5 if site == 1 else 1.0)  # a guard's clip
            update = strategy.read_update(reply(record(**trained), examples), base=current)
            flat = np.concatenate(
                [
                    (trained[k].astype(np.float64) - record_to_arrays(current)[k]).reshape(-1)
                    for k in ("w", "b")
                ]
            )
            updates.append((scale * flat, float(examples)))
            strategy.add_update(update, weight=examples, scale=scale)
        arrays, metrics = strategy.finish_aggregation()
        assert arrays is not None and metrics is not None and metrics["num-updates"] == 5
        flat_rounds.append(updates)
        x = x + naive_rounds(flat_rounds, 1.5)[-1]
        got = record_to_arrays(arrays)
        np.testing.assert_allclose(
            np.concatenate([got["w"].reshape(-1), got["b"]]), x, rtol=1e-5, atol=1e-5
        )
        x = np.concatenate([got["w"].reshape(-1), got["b"]]).astype(np.float64)
        current = arrays


def test_a_refused_step_keeps_the_centre() -> None:
    strategy = LocalSGDAveraging(aggregator="centered-clip", beta=0.9)
    top = np.finfo(np.float32).max
    base = record(w=np.zeros(2, np.float32))
    strategy.begin_aggregation(1, base)
    strategy.accumulate(reply(record(w=np.full(2, top, np.float32)), 1), base=base)
    arrays, _ = strategy.finish_aggregation()  # x = max: still finite; c = max
    assert arrays is not None
    centre = strategy.state_dict()["center"]["w"].copy()
    strategy.begin_aggregation(2, arrays)
    strategy.accumulate(reply(arrays, 1), base=arrays)  # Δ = 0: Δ̄ = 0, but x + 0.9·v overflows
    with pytest.raises(StepRefused, match="non-finite"):
        strategy.finish_aggregation()
    np.testing.assert_array_equal(strategy.state_dict()["center"]["w"], centre)


def test_running_statistics_keep_the_sites_mean_and_stay_out_of_the_distance() -> None:
    # Every site reports a running variance of 0.1 (from 1.0) and one sends its weights
    # ×50: the weights are clipped, the variance is the sites' mean, 0.1, every round
    # (clipped towards the last step it went below zero), and an integer counter of many
    # more steps does not make its site an outlier.
    model = {
        "w": np.zeros(4, np.float32),
        "bn.running_var": np.ones(3, np.float32),
        "bn.num_batches_tracked": np.zeros((), np.int64),
    }
    strategy = LocalSGDAveraging(aggregator="centered-clip")
    current = record(**model)
    rng = np.random.default_rng(1)
    for server_round in (1, 2, 3):
        strategy.begin_aggregation(server_round, current)
        sent = record_to_arrays(current)
        notes = []
        for site in range(4):
            step = rng.normal(size=4).astype(np.float32) * (50 if site == 3 else 1)
            trained = {
                "w": sent["w"] + step,
                "bn.running_var": np.full(3, 0.1, np.float32),
                "bn.num_batches_tracked": np.array(
                    sent["bn.num_batches_tracked"] + (300 if site else 100)
                ),
            }
            update = strategy.read_update(reply(record(**trained), 10), base=current)
            notes.append(strategy.add_update(update, weight=10))
        arrays, _ = strategy.finish_aggregation()
        assert arrays is not None
        got = record_to_arrays(arrays)
        np.testing.assert_allclose(got["bn.running_var"], 0.1, rtol=1e-6)
        assert got["bn.num_batches_tracked"] == sent["bn.num_batches_tracked"] + 250
        assert list(strategy.state_dict()["center"]) == ["w"]
        if server_round > 1:  # the ×50 site is the one clipped hardest
            assert notes[3] is not None
        current = arrays


def test_a_restored_centre_that_does_not_fit_the_model_stops_the_run_at_once() -> None:
    base = record(w=np.zeros((3, 4), np.float32), b=np.zeros(3, np.float32))
    strategy = LocalSGDAveraging(aggregator="centered-clip")
    saved = {
        "velocity": {},
        "compressing": set(),
        "center": {"w": np.zeros(7), "v": np.zeros(2)},
        "distances": [[1.0, 2.0]],
    }
    strategy.load_state_dict(saved)  # the model is not known yet: checked when it is
    with pytest.raises(CheckpointError, match=r"'center' holds arrays \['w', 'v'\]"):
        strategy.begin_aggregation(5, base)


def test_clip_radius_is_checked() -> None:
    for bad in (0, -1.0, float("nan"), "wide"):
        with pytest.raises(ConfigError, match="clip-radius must be a number > 0"):
            LocalSGDAveraging(aggregator="centered-clip", clip_radius=bad)  # type: ignore[arg-type]


def test_a_scaled_site_is_clipped_and_the_ledger_says_so() -> None:
    """Through the round engine with digits sites: a site that sends its update ×50 is
    counted inside the radius (the guard off, so that only centred clipping holds
    it), and its rows say by how much."""
    honest = digits_site(3, 4)

    def scaled(message: Message) -> Message:
        answer = honest(message)
        if message.metadata.message_type != MessageType.TRAIN:
            return answer
        sent = record_to_arrays(message.content["arrays"])
        trained = record_to_arrays(answer.content["arrays"])
        hostile = {
            k: (sent[k] + 50 * (trained[k] - sent[k])).astype(v.dtype) for k, v in sent.items()
        }
        answer.content["arrays"] = arrays_to_record(hostile)
        return answer

    grid = ScriptedGrid(
        {1: digits_site(0, 4), 2: digits_site(1, 4), 3: digits_site(2, 4), 4: scaled}
    )
    summaries: list[RoundSummary] = []
    RoundEngine(
        grid,
        LocalSGDAveraging(aggregator="centered-clip"),
        poll_interval=0.0,
        required_sites=4,
        on_round=summaries.append,
        guard=UpdateGuard(GuardOptions(norm_ratio=0.0, min_cosine=-1.0)),
    ).run(
        digits_model(),
        num_rounds=3,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 2, keys.LR: 0.1}),
    )
    for summary in summaries[1:]:  # round 1: the first updates come before a median
        assert len(summary.updates) == 4
        assert all(u.status == "applied" for u in summary.updates)
        factors = {
            u.site: float(re.fullmatch(r"centered-clip: offset .* counted x(\S+)", u.reason)[1])
            for u in summary.updates
            if u.reason
        }
        # tokyo (partition 3) counts a fiftieth or so of its offset; an honest site just
        # beyond the median distance loses a little of its own
        assert factors.pop("tokyo") < 0.1
        assert all(f > 0.5 for f in factors.values()), factors
