"""The update guard: hand-computed cases, a naive reference, and properties."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError
from flplatform.engine.guard import (
    CLEARLY_AWAY,
    DIRECTION_MEMORY,
    Decision,
    GuardOptions,
    Ruling,
    UpdateGuard,
    cosine,
    median,
    trim_window,
    vector_norm,
)


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
    assert decisions[1].ruling is Ruling.REJECT  # 5e29x: beyond max(100, ratio²), not clipped
    assert "beyond 100x, not clipped" in (decisions[1].reason or "")
    assert (decisions[2].scale, decisions[3].scale) == (1.0, 1.0)


def test_a_round_whose_step_was_refused_moves_neither_the_reference_nor_the_direction() -> None:
    """Its updates counted for nothing (the strategy refused the step: non-finite, out of
    the model's range); before, their norms joined the reference and their mean the
    direction all the same."""

    def reference(guard: UpdateGuard) -> tuple[list[list[float]], list[list[float]]]:
        kind = guard.state_dict()["kinds"]["delta"]
        return kind["rounds"], [part.tolist() for part in kind["direction"]]

    guard = warmed(GuardOptions(min_cosine=-0.5), [1.0, 1.0, 1.0])
    before = reference(guard)
    assert before == ([[1.0, 1.0, 1.0]], [[1.0, 0.0]])
    for site in (100, 101, 102):  # admitted: three times the median, at 45°
        decision = guard.consider(site, site=site, kind="delta", claimed=10, vector=vec(2.0, 2.0))
        assert decision.ruling is Ruling.ADMIT and decision.scale == 1.0
    guard.round_finished(stepped=False)
    assert reference(guard) == before
    # ... while a round that stepped moves both
    guard.begin_round(3)
    for site in (100, 101, 102):
        guard.consider(site, site=site, kind="delta", claimed=10, vector=vec(2.0, 2.0))
    guard.round_finished()
    norm = math.hypot(2.0, 2.0)
    assert reference(guard) == ([[1.0, 1.0, 1.0], [norm] * 3], [[2.5, 2.0]])  # ½·d + ū


@pytest.mark.parametrize("ratio,beyond", [(3, 100), (10, 100), (20, 400)])
def test_clipped_up_to_a_hundred_medians_or_ratio_squared_and_rejected_beyond(
    ratio: float, beyond: float
) -> None:
    guard = warmed(GuardOptions(norm_ratio=ratio), [1.0, 1.0, 1.0])
    clipped = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(beyond - 1, 0))
    assert clipped.ruling is Ruling.ADMIT and clipped.scale == pytest.approx(1 / (beyond - 1))
    rejected = guard.consider(2, site=2, kind="delta", claimed=10, vector=vec(beyond + 1, 0))
    assert rejected.ruling is Ruling.REJECT
    assert f"beyond {beyond:g}x, not clipped" in (rejected.reason or "")


def test_the_default_clips_an_update_five_times_the_median() -> None:
    # A site scaling its honest update by 5 (the hostile benchmark's scaled:5).
    guard = warmed(GuardOptions(), [1.0, 1.0, 1.0])
    scaled = guard.consider(1, site=1, kind="delta", claimed=10, vector=vec(5, 0))
    assert scaled.ruling is Ruling.ADMIT and scaled.scale == pytest.approx(1 / 5)
    assert "5x the recent median 1 (update-norm-ratio 3)" in (scaled.reason or "")


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


def test_the_replay_check_keeps_a_bounded_memory_of_each_sites_replies() -> None:
    """The newest REPLAY_MEMORY fingerprints of a site are kept (its checkpoint with them):
    every one was kept before, and a run of many sites and rounds grew every checkpoint."""
    from flplatform.engine.guard import REPLAY_MEMORY

    guard = UpdateGuard(GuardOptions(norm_ratio=0))
    for number in range(REPLAY_MEMORY + 1):
        guard.begin_round(number + 1)
        mark = (f"reply-{number}",)
        assert (
            guard.consider(
                number, site=7, kind="delta", claimed=1, vector=vec(1), fingerprint=mark
            ).ruling
            is Ruling.ADMIT
        )
        guard.round_finished()
    kept = guard.state_dict()["seen"][7]
    assert len(kept) == REPLAY_MEMORY and ("reply-0",) not in kept
    newest = guard.consider(
        0, site=7, kind="delta", claimed=1, vector=vec(1), fingerprint=(f"reply-{REPLAY_MEMORY}",)
    )
    assert newest.ruling is Ruling.REJECT  # still known
    restored = UpdateGuard(GuardOptions(norm_ratio=0))
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict()["seen"] == guard.state_dict()["seen"]


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


def test_the_share_caps_the_first_rounds_claims_when_no_site_declared_any() -> None:
    """Found by a review: the first round's updates wait for a reference, and their weight
    was fixed on arrival, when (no site having declared its examples, as a plain Flower
    ClientApp does not) nothing was known of the others: a claim of 10¹² owned round 1."""
    guard = UpdateGuard(GuardOptions(max_share=0.5))
    guard.begin_round(1)
    for site, claimed in ((1, 100), (2, 10**12), (3, 100)):
        held = guard.consider(site, site=site, kind="delta", claimed=claimed, vector=vec(1))
        assert held.ruling is Ruling.WAIT
    decisions = guard.ready()
    # s/(1 − s) · others: the liar at most the two others' 200; they, beside the liar, whole
    assert decisions[2].weight == pytest.approx(200)
    assert "max-site-share 0.5" in (decisions[2].reason or "")
    assert decisions[1].weight == decisions[3].weight == 100


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
    """Hand-worked, λ = 0.9: cos(u, e1) is u's first coordinate for a unit u; a site's
    mean starts at its first cosine, then c̄ ← 0.9·c̄ + 0.1·cos."""
    assert DIRECTION_MEMORY == 0.9 and CLEARLY_AWAY == 0.5
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    # The flipper's first judged update: its mean is its cosine, −0.4.
    first = guard.consider(1, site=7, kind="delta", claimed=10, vector=vec(-0.4, 0.9165))
    assert first.ruling is Ruling.REJECT
    assert first.reason == "direction: cosine -0.40 with the recent updates < update-min-cosine 0"
    for ticket in (2, 3):  # the mean stays −0.4
        guard.consider(ticket, site=7, kind="delta", claimed=10, vector=vec(-0.4, 0.9165))
    # One update along the direction does not undo them: 0.9·(−0.4) + 0.1·0.8 = −0.28.
    fourth = guard.consider(4, site=7, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    assert fourth.ruling is Ruling.REJECT
    assert fourth.reason == (
        "direction: its recent mean cosine -0.28 < update-min-cosine 0 (this one: 0.80)"
    )
    assert len(fourth.reason) <= 80  # what `history updates` shows of a reason
    # An honest site that once points slightly away stays admitted: 0.9·0.5 + 0.1·(−0.2).
    honest = guard.consider(5, site=8, kind="delta", claimed=10, vector=vec(0.5, 0.866))
    assert honest.ruling is Ruling.ADMIT
    dip = guard.consider(6, site=8, kind="delta", claimed=10, vector=vec(-0.2, 0.98))
    assert dip.ruling is Ruling.ADMIT
    mean, judged = guard._kinds["delta"].cosines[8]
    assert judged == 2 and mean == pytest.approx(0.43, abs=1e-4)


def test_an_update_far_below_the_bound_is_rejected_whatever_its_sites_mean() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    for ticket in range(10):  # banked credit: mean 1
        guard.consider(ticket, site=8, kind="delta", claimed=10, vector=vec(1, 0))
    flip = guard.consider(10, site=8, kind="delta", claimed=10, vector=vec(-0.6, 0.8))
    assert flip.ruling is Ruling.REJECT
    assert flip.reason == (
        "direction: cosine -0.60 with the recent updates < update-min-cosine 0 - 0.5"
    )
    # A slight dip within the margin is the mean's to judge: admitted on the credit.
    slight = guard.consider(11, site=8, kind="delta", claimed=10, vector=vec(-0.3, 0.954))
    assert slight.ruling is Ruling.ADMIT


def test_a_site_that_stops_pointing_away_is_admitted_once_its_mean_recovers() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    for ticket in range(20):  # mean −0.3
        guard.consider(ticket, site=7, kind="delta", claimed=10, vector=vec(-0.3, 0.954))
    rulings = [
        guard.consider(t, site=7, kind="delta", claimed=10, vector=vec(1, 0)).ruling
        for t in range(20, 24)
    ]
    # −0.3 → −0.17, −0.053, +0.052, ...
    assert rulings == [Ruling.REJECT, Ruling.REJECT, Ruling.ADMIT, Ruling.ADMIT]


def naive_mean_cosine(cosines: list[float], memory: float) -> float:
    """λⁿ⁻¹·cos₁ + Σᵢ₌₂ⁿ λⁿ⁻ⁱ·(1 − λ)·cosᵢ, written out (the guard updates it step by step)."""
    n = len(cosines)
    return memory ** (n - 1) * cosines[0] + sum(
        memory ** (n - i) * (1 - memory) * c for i, c in enumerate(cosines[1:], 2)
    )


@given(
    cosines=st.lists(st.floats(-1, 1), min_size=1, max_size=12),
    bound=st.floats(-0.99, 1),
)
def test_the_direction_ruling_matches_a_naive_mean(cosines: list[float], bound: float) -> None:
    guard = a_guard_with_direction_e1(min_cosine=bound)
    for n, c in enumerate(cosines, 1):
        decision = guard.consider(
            n, site=7, kind="delta", claimed=10, vector=vec(c, math.sqrt(1 - c * c))
        )
        mean = naive_mean_cosine(cosines[:n], DIRECTION_MEMORY)
        assert guard._kinds["delta"].cosines[7] == (pytest.approx(mean, abs=1e-9), n)
        if abs(mean - bound) > 1e-9 and abs(c - (bound - CLEARLY_AWAY)) > 1e-9:  # not ties
            expected = mean < bound or c < bound - CLEARLY_AWAY
            assert (decision.ruling is Ruling.REJECT) == expected, (c, mean)


def test_the_direction_and_its_norm_follow_the_rounds_and_a_checkpoint() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.5)
    for r, update in ((2, vec(0.6, 0.8)), (3, vec(0.9, 0.1))):
        guard.begin_round(r)
        assert guard.consider(r, site=100, kind="delta", claimed=10, vector=update).ruling is (
            Ruling.ADMIT
        )
        guard.round_finished()
        kind = guard._kinds["delta"]
        assert kind.direction is not None
        assert kind.direction_norm == pytest.approx(vector_norm(kind.direction))
    # d = ½·(½·e1 + (0.6, 0.8)) + (0.9, 0.1) = (1.45, 0.5); a bound of 0.5 decides by ‖d‖
    np.testing.assert_allclose(guard._kinds["delta"].direction[0], [1.45, 0.5])
    # cos((0.1, 1), d) = (0.145 + 0.5) / (1.005·1.534) = 0.418 < 0.5; with a ‖d‖ left at
    # round 1's (1) it would pass as 0.642
    below = vec(0.1, 1.0)
    assert cosine(below, guard._kinds["delta"].direction) == pytest.approx(0.4184, abs=1e-4)
    assert guard.consider(9, site=9, kind="delta", claimed=10, vector=below).ruling is (
        Ruling.REJECT
    )
    restored = UpdateGuard(guard.options)
    restored.load_state_dict(guard.state_dict())
    kind = restored._kinds["delta"]
    assert kind.direction is not None
    assert kind.direction_norm == pytest.approx(vector_norm(kind.direction))
    assert restored.consider(10, site=10, kind="delta", claimed=10, vector=below).ruling is (
        Ruling.REJECT
    )


def test_the_sites_mean_cosines_survive_a_checkpoint_under_new_node_ids() -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    for ticket in (1, 2, 3):
        guard.consider(ticket, site=7, kind="delta", claimed=10, vector=vec(-0.4, 0.9165))
    guard.round_finished()
    saved = guard.state_dict()
    restored = UpdateGuard(guard.options)
    restored.load_state_dict(saved, nodes={100: 1, 101: 2, 102: 3, 7: 70})
    assert restored._kinds["delta"].cosines == {70: (pytest.approx(-0.4, abs=1e-4), 3)}
    # The same next update gets the same ruling and reason as it would have had.
    expected = guard.consider(4, site=7, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    got = restored.consider(4, site=70, kind="delta", claimed=10, vector=vec(0.8, 0.6))
    assert got == expected and got.ruling is Ruling.REJECT
    # A checkpoint written before the means were kept loads with none known.
    del saved["kinds"]["delta"]["cosines"]
    older = UpdateGuard(guard.options)
    older.load_state_dict(saved)
    assert older._kinds["delta"].cosines == {}


@pytest.mark.parametrize("judged", [[math.nan, 3], [5.0, 3], [0.2, 0], [0.2, True], 0.2, [0.2]])
def test_a_saved_mean_cosine_out_of_range_is_refused_naming_the_site(judged: object) -> None:
    guard = a_guard_with_direction_e1(min_cosine=0.0)
    saved = guard.state_dict()
    saved["kinds"]["delta"]["cosines"] = {7: judged}
    fresh = UpdateGuard(guard.options)
    with pytest.raises(CheckpointError, match=r"mean cosine of site 7 \('delta'\)"):
        fresh.load_state_dict(saved)
    assert fresh._kinds == {}  # unchanged


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
        if norm > max(100.0, ratio * ratio) * reference:
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


def test_waiting_updates_are_judged_once_min_reference_norms_are_there() -> None:
    guard = UpdateGuard(GuardOptions(norm_ratio=10, min_reference=3))
    guard.begin_round(1)
    first = [
        guard.consider(t, site=t, kind="delta", claimed=10, vector=vec(n, 0))
        for t, n in ((1, 1e30), (2, 1.0))
    ]
    assert [d.ruling for d in first] == [Ruling.WAIT] * 2
    assert guard.ready() == {}  # two norms: not enough for a reference yet
    third = guard.consider(3, site=3, kind="delta", claimed=10, vector=vec(2.0, 0))
    assert third.ruling is Ruling.WAIT
    decisions = guard.ready()  # the median of {1e30, 1, 2} = 2, as settle() would judge
    assert sorted(decisions) == [1, 2, 3]
    assert decisions[1].ruling is Ruling.REJECT and "beyond 100x" in (decisions[1].reason or "")
    assert decisions[2].ruling is decisions[3].ruling is Ruling.ADMIT
    # two norms are known now (the huge one was rejected): the next waits for a third
    fourth = guard.consider(4, site=4, kind="delta", claimed=10, vector=vec(1.5, 0))
    assert fourth.ruling is Ruling.WAIT
    assert list(guard.ready()) == [4]
    # three known: judged on arrival; another kind still waits for its own norms
    fifth = guard.consider(5, site=5, kind="delta", claimed=10, vector=vec(40.0, 0))
    assert fifth.ruling is Ruling.ADMIT and fifth.scale == pytest.approx(1.5 / 40)  # median
    sketch = guard.consider(6, site=6, kind="sketch", claimed=10, vector=vec(5.0, 0))
    assert sketch.ruling is Ruling.WAIT and guard.ready() == {}
    assert list(guard.settle()) == [6]  # the round's close judges what still waits


# ------------------------------------------------ one update a round (async, K = 1)
def test_a_site_sending_every_other_round_cannot_grow_its_norm_round_by_round() -> None:
    """Found by a review: with a window of rounds alone, a round that applies one update
    left two norms known, so each update waited and was judged against a median that
    counted it: a site sending three times the largest recent norm was admitted whole,
    every other round (3, 9, 27, ... 2187 by round 14)."""
    guard = UpdateGuard(GuardOptions())  # ratio 3, window of 3 rounds, min_reference 3
    counted, waited = [], []
    for server_round in range(1, 15):
        guard.begin_round(server_round)
        honest = server_round % 2 == 1
        known = (
            [n for past in guard._kinds["delta"].rounds for n in past] if server_round > 1 else []
        )
        norm = 1.0 if honest else 3.0 * max(known, default=1.0)
        decision = guard.consider(
            server_round, site=1 if honest else 2, kind="delta", claimed=10, vector=vec(norm, 0)
        )
        if decision.ruling is Ruling.WAIT:
            waited.append(server_round)
            decision = guard.ready().get(server_round) or guard.settle()[server_round]
        assert decision.ruling is Ruling.ADMIT
        if not honest:
            counted.append(norm * decision.scale)
        guard.round_finished()
    assert waited == [1, 2, 3]  # from round 4 three norms are known: judged on arrival
    assert max(counted) <= 3.0 + 1e-9  # at most three honest norms, however many turns


def test_the_window_keeps_whole_rounds_and_enough_norms_before_them() -> None:
    rounds = deque([[1.0], [2.0], [3.0]])
    trim_window(rounds, keep=2, at_least=3)  # one norm a round: the oldest stays, merged
    assert list(rounds) == [[1.0, 2.0], [3.0]]
    rounds.append([4.0])
    trim_window(rounds, keep=2, at_least=3)
    assert list(rounds) == [[2.0, 3.0], [4.0]]  # the newest three
    synchronous = deque([[1.0] * 4, [2.0] * 4, [3.0] * 4])
    trim_window(synchronous, keep=2, at_least=3)  # four a round: the oldest round goes
    assert list(synchronous) == [[2.0] * 4, [3.0] * 4]
    alone = deque([[1.0, 2.0], [3.0]])
    trim_window(alone, keep=0, at_least=2)  # no past round kept, but two norms
    assert list(alone) == [[2.0, 3.0]]


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(st.lists(st.integers(0, 99), max_size=4), min_size=1, max_size=8),
    keep=st.integers(0, 4),
    at_least=st.integers(1, 6),
)
def test_the_window_holds_the_last_rounds_and_the_newest_values_a_reference_needs(
    rounds: list[list[int]], keep: int, at_least: int
) -> None:
    window = deque([float(v) for v in values] for values in rounds)
    trim_window(window, keep=keep, at_least=at_least)
    # naive: the last ``keep`` rounds whole, then older values newest first until
    # ``at_least`` are held (or none are left)
    split = max(0, len(rounds) - keep)
    recent = [v for values in rounds[split:] for v in values]
    older = [v for values in rounds[:split] for v in values]
    needed = max(0, at_least - len(recent))
    wanted = older[max(0, len(older) - needed) :] if needed else []
    assert [v for values in window for v in values] == [float(v) for v in wanted + recent]
    assert len(window) <= max(keep, 1)


# ------------------------------------ arrays averaged as they are (running statistics)
def test_counters_in_an_update_do_not_hide_its_weights_scaled_a_hundredfold() -> None:
    """Found by a review: a ResNet's update after 20 local steps had norm 94.1, of which its
    BatchNorm counters 89.4 and running statistics 29.1, its weights 1.9; judged in one
    norm, an update with its weights ×100 (norm 214 against a median of 94) was admitted
    whole. Judged apart, the weights are clipped and the counters admitted."""
    guard = UpdateGuard(GuardOptions())
    guard.begin_round(1)
    counters = vec(89.4, 29.1)
    for site in (1, 2, 3):
        guard.consider(
            site, site=site, kind="delta", claimed=10, vector=vec(1.9), averaged=counters
        )
    assert all(d.ruling is Ruling.ADMIT and d.scale == 1.0 for d in guard.ready().values())
    guard.round_finished()
    guard.begin_round(2)
    scaled = guard.consider(4, site=4, kind="delta", claimed=10, vector=vec(190), averaged=counters)
    assert scaled.ruling is Ruling.ADMIT and scaled.scale == pytest.approx(1.9 / 190)
    honest = guard.consider(5, site=5, kind="delta", claimed=10, vector=vec(2.5), averaged=counters)
    assert (honest.ruling, honest.scale) == (Ruling.ADMIT, 1.0)


def test_running_statistics_far_beyond_their_median_reject_the_update() -> None:
    guard = UpdateGuard(GuardOptions())
    guard.begin_round(1)
    first = [
        guard.consider(t, site=t, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(a))
        for t, a in ((1, 1.0), (2, 1e6), (3, 2.0))
    ]
    assert [d.ruling for d in first] == [Ruling.WAIT] * 3
    decisions = guard.ready()  # judged together: the median of {1, 1e6, 2} is 2
    assert decisions[1].ruling is decisions[3].ruling is Ruling.ADMIT
    assert decisions[2].ruling is Ruling.REJECT
    assert "running statistics: norm 1e+06" in (decisions[2].reason or "")
    fourth = guard.consider(4, site=4, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(3))
    assert fourth.ruling is Ruling.WAIT and guard.ready()[4].ruling is Ruling.ADMIT
    guard.round_finished()
    guard.begin_round(2)
    # on arrival against {1, 2} and the round before's: within 100x is admitted whole (they
    # are averaged, not stepped: no clipping), beyond is rejected
    within = guard.consider(4, site=4, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(150))
    assert (within.ruling, within.scale) == (Ruling.ADMIT, 1.0)
    beyond = guard.consider(5, site=5, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(1e4))
    assert beyond.ruling is Ruling.REJECT and "beyond 100x" in (beyond.reason or "")
    overflow = guard.consider(
        6, site=6, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(1e200, 1e200)
    )
    assert overflow.ruling is Ruling.REJECT and "overflows" in (overflow.reason or "")
    # their window survives a checkpoint
    guard.round_finished()
    restored = UpdateGuard(GuardOptions())
    restored.load_state_dict(guard.state_dict())
    restored.begin_round(3)
    again = restored.consider(
        7, site=7, kind="delta", claimed=10, vector=vec(1.0), averaged=vec(1e4)
    )
    assert again.ruling is Ruling.REJECT and "running statistics" in (again.reason or "")
