"""The update guard: hand-computed cases, a naive reference, and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.engine.guard import (
    DIRECTION_MEMORY,
    Decision,
    GuardOptions,
    Ruling,
    UpdateGuard,
    cosine,
    median,
    vector_norm,
)
from flplatform.errors import ConfigError


def vec(*values: float) -> list[np.ndarray]:
    return [np.array(values, dtype=np.float64)]


def warmed(options: GuardOptions, norms: list[float]) -> UpdateGuard:
    """A guard whose first round admitted updates of these norms (along e1)."""
    guard = UpdateGuard(options)
    guard.begin_round(1)
    for site, norm in enumerate(norms, start=100):
        decision = guard.consider(site, site=site, kind="delta", claimed=10, vector=vec(norm, 0))
        assert decision.ruling in (Ruling.WAIT, Ruling.ADMIT)
    assert all(d.ruling is Ruling.ADMIT for d in guard.settle().values())
    guard.round_finished()
    guard.begin_round(2)
    return guard


# ------------------------------------------------------------------ golden cases
def test_an_update_thirty_times_the_median_is_clipped_to_it() -> None:
    guard = warmed(GuardOptions(norm_ratio=10), [1.0, 2.0, 3.0])  # median 2
    decision = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(60, 0))
    # 60 / 2 = 30x > 10x: scaled by 2/60 to the median's norm, its weight untouched
    assert decision.ruling is Ruling.ADMIT
    assert decision.scale == pytest.approx(2 / 60) and decision.weight == 10
    assert "norm 60 is 30x the recent median 2" in (decision.reason or "")
    assert "clipped" in (decision.reason or "")
    # within the ratio: counted as it is, nothing to say
    fine = guard.consider(2, site=2, kind="delta", claimed=10, vector=vec(19, 0))
    assert (fine.ruling, fine.scale, fine.reason) == (Ruling.ADMIT, 1.0, None)


def test_reject_action_rejects_instead() -> None:
    guard = warmed(GuardOptions(norm_ratio=10, norm_action="reject"), [1.0, 1.0, 1.0])
    decision = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(1e30, 0))
    assert decision.ruling is Ruling.REJECT
    assert "1e+30x the recent median 1" in (decision.reason or "")


def test_a_huge_first_arrival_waits_and_cannot_become_the_reference() -> None:
    guard = UpdateGuard(GuardOptions(norm_ratio=10))
    guard.begin_round(1)
    rulings = [
        guard.consider(t, site=t, kind="delta", claimed=10, vector=vec(n, 0))
        for t, n in ((1, 1e30), (2, 1.0), (3, 2.0))
    ]
    assert [d.ruling for d in rulings] == [Ruling.WAIT] * 3
    decisions = guard.settle()  # reference: the median of {1e30, 1, 2} = 2
    assert decisions[1].ruling is Ruling.REJECT  # 5e29x: beyond ratio² = 100, not clipped
    assert "beyond 100x, not clipped" in (decisions[1].reason or "")
    assert (decisions[2].scale, decisions[3].scale) == (1.0, 1.0)


def test_clipped_up_to_ratio_squared_and_rejected_beyond() -> None:
    guard = warmed(GuardOptions(norm_ratio=10), [1.0, 1.0, 1.0])
    clipped = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(99, 0))
    assert clipped.ruling is Ruling.ADMIT and clipped.scale == pytest.approx(1 / 99)
    rejected = guard.consider(2, site=2, kind="delta", claimed=10, vector=vec(101, 0))
    assert rejected.ruling is Ruling.REJECT


def test_two_honest_sites_far_apart_are_both_admitted() -> None:
    # Non-IID sites' norms differ widely; with two, the median is their mean.
    guard = UpdateGuard(GuardOptions(norm_ratio=10, norm_action="reject"))
    guard.begin_round(1)
    guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(0.008, 0))
    guard.consider(2, site=2, kind="delta", claimed=10, vector=vec(1.2, 0))
    decisions = guard.settle()
    assert all(d.ruling is Ruling.ADMIT for d in decisions.values())


def test_with_three_sites_one_huge_update_is_outvoted() -> None:
    guard = UpdateGuard(GuardOptions(norm_ratio=10, norm_action="reject"))
    guard.begin_round(1)
    for ticket, norm in ((1, 1.0), (2, 1e6), (3, 2.0)):
        guard.consider(ticket, site=ticket, kind="delta", claimed=10, vector=vec(norm, 0))
    decisions = guard.settle()  # median 2
    assert [decisions[t].ruling for t in (1, 2, 3)] == [Ruling.ADMIT, Ruling.REJECT, Ruling.ADMIT]


def test_kinds_are_compared_only_with_their_own() -> None:
    guard = warmed(GuardOptions(norm_ratio=10), [1.0, 1.0, 1.0])
    decision = guard.consider(1, site=1, kind="sketch", claimed=10, vector=vec(1e3, 0))
    assert decision.ruling is Ruling.WAIT  # no sketch norms known yet


def test_a_replayed_reply_is_rejected_naming_the_round_it_copies() -> None:
    guard = UpdateGuard(GuardOptions(norm_ratio=0))
    guard.begin_round(1)
    first = guard.consider(1, site=7, kind="delta", claimed=1, vector=vec(1), fingerprint=("a",))
    assert first.ruling is Ruling.ADMIT
    guard.round_finished()
    guard.begin_round(4)
    again = guard.consider(2, site=7, kind="delta", claimed=1, vector=vec(1), fingerprint=("a",))
    assert again.ruling is Ruling.REJECT
    assert again.reason == "identical to its reply of round 1: a replayed update"
    # another site sending the same bytes is not replaying its own reply
    other = guard.consider(3, site=8, kind="delta", claimed=1, vector=vec(1), fingerprint=("a",))
    assert other.ruling is Ruling.ADMIT


def test_weight_is_capped_by_the_declared_examples_and_the_share() -> None:
    guard = UpdateGuard(GuardOptions(norm_ratio=0, max_share=0.5))
    for site, declared in ((1, 300), (2, 300), (3, 400)):
        guard.declare(site, declared)
    guard.begin_round(1)
    # claims 10^12 but declared 400: weighted as 400; the others hold 600 ≥ 400, no share cap
    liar = guard.consider(1, site=3, kind="delta", claimed=10**12, vector=vec(1))
    assert liar.weight == 400
    assert "claimed 1000000000000 examples but declared 400" in (liar.reason or "")
    # a site that declared nothing: at most s/(1−s)·others = 1·(300 + 300 + 400)
    guard.declare(4, None)
    quiet = guard.consider(2, site=4, kind="delta", claimed=5000, vector=vec(1))
    assert quiet.weight == pytest.approx(1000)
    assert "max-site-share 0.5" in (quiet.reason or "")


def test_a_sign_flipped_update_is_rejected_and_an_honest_one_admitted() -> None:
    guard = warmed(GuardOptions(norm_ratio=10, min_cosine=-0.1), [1.0, 1.0, 1.0])
    flipped = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(-1, 0.2))
    assert flipped.ruling is Ruling.REJECT
    assert "cosine -0.98" in (flipped.reason or "")
    honest = guard.consider(2, site=2, kind="delta", claimed=10, vector=vec(1, 0.5))
    assert honest.ruling is Ruling.ADMIT


def test_the_direction_is_a_moving_average_of_the_round_means() -> None:
    guard = warmed(GuardOptions(norm_ratio=0, min_cosine=0.0), [1.0])  # d = e1
    guard.consider(1, site=1, kind="delta", claimed=1, vector=vec(0, 3))
    guard.round_finished()  # d = ½·e1 + 3·e2
    assert guard._kinds["delta"].direction is not None
    np.testing.assert_allclose(guard._kinds["delta"].direction[0], [0.5, 3.0])


def a_guard_with_direction_e1(min_cosine: float) -> UpdateGuard:
    """A guard whose direction is e1 (round 1 admitted (1, 0) from sites 100-102)."""
    return warmed(GuardOptions(norm_ratio=0, min_cosine=min_cosine), [1.0, 1.0, 1.0])


def test_a_site_is_judged_by_its_recent_cosines_not_one_round_of_noise() -> None:
    """Hand-worked, λ = 0.9: cos(u, e1) is u's first coordinate for a unit u."""
    assert DIRECTION_MEMORY == 0.9
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    # The flipper's first judged update: its average is its cosine, −0.6.
    first = guard.consider(1, site=7, kind="delta", claimed=10, vector=vec(-0.6, 0.8))
    assert first.ruling is Ruling.REJECT
    assert first.reason == (
        "direction: cosine -0.60 with the federation's recent updates, below update-min-cosine 0"
    )
    # One update along the direction does not undo it: 0.9·(−0.6) + 0.1·0.8 = −0.46.
    second = guard.consider(2, site=7, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    assert second.ruling is Ruling.REJECT
    assert second.reason == (
        "direction: cosine 0.80 with the federation's recent updates, "
        "the site's recent average -0.46, below update-min-cosine 0"
    )
    # An honest site that once pointed slightly away stays admitted: 0.9·0.5 + 0.1·(−0.2).
    assert guard.consider(3, site=8, kind="delta", claimed=10, vector=vec(0.5, 0.866)).ruling is (
        Ruling.ADMIT
    )
    dip = guard.consider(4, site=8, kind="delta", claimed=10, vector=vec(-0.2, 0.98))
    assert dip.ruling is Ruling.ADMIT
    assert guard._kinds["delta"].cosines[8] == pytest.approx(0.43, abs=1e-4)


def test_a_site_that_stops_pointing_away_is_admitted_once_its_average_recovers() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    guard.consider(1, site=7, kind="delta", claimed=10, vector=vec(-0.5, 0))  # average −1
    rulings = [
        guard.consider(t, site=7, kind="delta", claimed=10, vector=vec(1, 0)).ruling
        for t in range(2, 12)
    ]
    # −1 → 0.9·c̄ + 0.1: −0.8, −0.62, −0.458, −0.312, −0.181, −0.063, +0.043, ...
    assert rulings == [Ruling.REJECT] * 6 + [Ruling.ADMIT] * 4


@given(
    cosines=st.lists(st.floats(-1, 1), min_size=1, max_size=12),
    bound=st.floats(-0.99, 1),
)
def test_the_direction_ruling_matches_a_naive_running_average(
    cosines: list[float], bound: float
) -> None:
    guard = a_guard_with_direction_e1(min_cosine=bound)
    average = None
    for ticket, c in enumerate(cosines):
        s = math.sqrt(max(0.0, 1 - c * c))
        average = c if average is None else 0.9 * average + 0.1 * c
        decision = guard.consider(ticket, site=7, kind="delta", claimed=10, vector=vec(c, s))
        if abs(average - bound) > 1e-9:  # the exact tie is rounding's to decide
            assert (decision.ruling is Ruling.REJECT) == (average < bound), (c, average)


def test_the_sites_recent_cosines_survive_a_checkpoint_under_new_node_ids() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    guard.consider(1, site=7, kind="delta", claimed=10, vector=vec(-0.6, 0.8))
    guard.round_finished()
    saved = guard.state_dict()
    restored = UpdateGuard(guard.options)
    restored.load_state_dict(saved, nodes={100: 1, 101: 2, 102: 3, 7: 70})
    assert restored._kinds["delta"].cosines == {70: pytest.approx(-0.6)}
    # The same next update gets the same ruling and reason as it would have had.
    expected = guard.consider(2, site=7, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    got = restored.consider(2, site=70, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    assert got == expected and got.ruling is Ruling.REJECT
    # A checkpoint written before the averages were kept loads with none known.
    del saved["kinds"]["delta"]["cosines"]
    older = UpdateGuard(guard.options)
    older.load_state_dict(saved)
    assert older._kinds["delta"].cosines == {}


def test_options_off_admit_everything_as_claimed() -> None:
    guard = UpdateGuard(GuardOptions.off())
    guard.declare(1, 10)
    guard.begin_round(1)
    for ticket in range(3):
        decision = guard.consider(
            ticket, site=1, kind="delta", claimed=10**12, vector=vec(1e30), fingerprint=("x",)
        )
        assert decision == Decision(Ruling.ADMIT, weight=1e12, scale=1.0, reason=None)


def test_a_norm_that_overflows_is_rejected() -> None:
    guard = UpdateGuard()
    decision = guard.consider(1, site=1, kind="delta", claimed=1, vector=vec(1e200, 1e200))
    assert decision.ruling is Ruling.REJECT and "overflows" in (decision.reason or "")


@pytest.mark.parametrize(
    "options",
    [
        dict(norm_ratio=0.5),
        dict(norm_ratio=-1),
        dict(norm_action="drop"),
        dict(max_share=0.0),
        dict(max_share=1.5),
        dict(min_cosine=2.0),
        dict(reject_replays="yes"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options: dict) -> None:
    with pytest.raises(
        ConfigError,
        match="update-norm-ratio|update-norm-action|max-site-share|update-min-cosine|reject-replays",
    ):
        GuardOptions(**options)


# ------------------------------------------------------ naive reference, properties
def naive_decisions(history: list[float], norms: list[float], ratio: float) -> list[float]:
    """The scale each update gets (0: rejected), the slow, obvious way (sequentially)."""
    accepted = list(history)
    scales = []
    for norm in norms:
        reference = float(np.median(accepted))
        if norm > ratio * ratio * reference:
            scales.append(0.0)
            continue
        scale = reference / norm if norm > ratio * reference else 1.0
        scales.append(scale)
        accepted.append(norm * scale)
    return scales


@settings(max_examples=60, deadline=None)
@given(
    # (a warm-up all admitted as it is: within a factor 2, and ratio > 2)
    history=st.lists(st.floats(1.0, 2.0), min_size=3, max_size=8),
    norms=st.lists(st.floats(0.01, 1e6), min_size=1, max_size=6),
    ratio=st.floats(2.5, 20.0),
)
def test_clipping_matches_the_naive_reference(
    history: list[float], norms: list[float], ratio: float
) -> None:
    guard = warmed(GuardOptions(norm_ratio=ratio, min_cosine=-1.0, window_rounds=2), history)
    decisions = [
        guard.consider(t, site=t, kind="delta", claimed=1, vector=vec(n, 0))
        for t, n in enumerate(norms)
    ]
    scales = [d.scale if d.ruling is Ruling.ADMIT else 0.0 for d in decisions]
    np.testing.assert_allclose(scales, naive_decisions(history, norms, ratio), rtol=1e-9)
    # whatever was sent, what counts is at most ratio × the reference it was judged on
    for scale, norm in zip(scales, norms, strict=True):
        assert norm * scale <= ratio * max(max(history), max(norms)) * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    parts=st.lists(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=5), min_size=1, max_size=3),
    factor=st.floats(0.1, 10),
)
def test_norm_and_cosine_match_numpy(parts: list[list[float]], factor: float) -> None:
    arrays = [np.array(p) for p in parts]
    flat = np.concatenate(arrays)
    assert vector_norm(arrays) == pytest.approx(float(np.linalg.norm(flat)), rel=1e-9, abs=1e-12)
    scaled = [a * factor for a in arrays]
    cos = cosine(arrays, scaled)
    if np.linalg.norm(flat) > 1e-6:
        assert cos == pytest.approx(1.0, rel=1e-9)
    else:
        assert cos is None or math.isfinite(cos)


def test_median() -> None:
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert median([5]) == 5
    with pytest.raises(ValueError):
        median([])


def test_a_zero_dimensional_part_of_every_update_joins_the_direction() -> None:
    # (BatchNorm's counter is a 0-d array.) Each admitted update's 0-d part must be summed,
    # not only the first one's.
    guard = UpdateGuard(GuardOptions(norm_ratio=0, min_cosine=0.0))
    guard.begin_round(1)
    for site, value in ((1, 1.0), (2, 3.0)):
        vector = [np.array([value, 0.0], np.float32), np.array(value, np.float32)]
        guard.consider(site, site=site, kind="delta", claimed=1, vector=vector)
    guard.round_finished()  # the mean of the two updates: (2, 0) and 2
    direction = guard._kinds["delta"].direction
    assert direction is not None
    np.testing.assert_allclose(direction[0], [2.0, 0.0])
    assert float(direction[1]) == pytest.approx(2.0)
