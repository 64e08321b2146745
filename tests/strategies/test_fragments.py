"""Streaming sync's fragments against a brute-force reference, Hypothesis properties and
hand-computed cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.core.errors import ConfigError
from strategies.fragments import changed_since, fragment_of_round, split_fragments


def best_peak(values: list[int], count: int) -> int:
    """The smallest largest-fragment over every contiguous split (naive: all cut sets)."""
    n = len(values)
    best = None
    for cuts in itertools.combinations(range(1, n), count - 1):
        bounds = (0, *cuts, n)
        peak = max(sum(values[a:b]) for a, b in itertools.pairwise(bounds))
        best = peak if best is None else min(best, peak)
    assert best is not None
    return best


def named(values: list[int]) -> list[tuple[str, int]]:
    return [(f"layer{i}", v) for i, v in enumerate(values)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_split_is_contiguous_complete_and_as_balanced_as_the_best_split(values, count):
    if count > len(values):
        with pytest.raises(ConfigError, match=f"at most {len(values)} fragments"):
            split_fragments(named(values), count)
        return
    sizes = named(values)
    fragments = split_fragments(sizes, count)
    assert len(fragments) == count
    assert all(fragments)  # none empty
    # in the model's order, every array exactly once
    assert [name for fragment in fragments for name in fragment] == [n for n, _ in sizes]
    by_name = dict(sizes)
    peak = max(sum(by_name[n] for n in fragment) for fragment in fragments)
    assert peak == best_peak(values, count)


def test_hand_computed_splits():
    assert split_fragments(named([4, 4, 4, 4]), 2) == (("layer0", "layer1"), ("layer2", "layer3"))
    # one large array is a fragment of its own; the small ones share the other
    assert split_fragments(named([10, 1, 1, 1, 1]), 2) == (
        ("layer0",),
        ("layer1", "layer2", "layer3", "layer4"),
    )
    # cuts as late as the peak (10) allows, but each array left owed its own fragment
    assert split_fragments(named([1, 1, 1, 10]), 3) == (
        ("layer0", "layer1"),
        ("layer2",),
        ("layer3",),
    )
    assert split_fragments(named([5, 5, 1]), 1) == (("layer0", "layer1", "layer2"),)


def test_schedule_and_what_a_site_lacks():
    assert [fragment_of_round(r, 4) for r in range(1, 10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [fragment_of_round(r, 1) for r in range(1, 4)] == [0, 0, 0]
    assert changed_since(3, 4, 4) == [3]  # version 4 is round 4's: fragment 3
    assert changed_since(2, 4, 4) == [2, 3]  # rounds 3 and 4
    assert changed_since(4, 4, 4) == []
    assert changed_since(6, 9, 4) == [0, 2, 3]  # rounds 7, 8, 9: fragments 2, 3, 0
    assert changed_since(0, 9, 4) == [0, 1, 2, 3]


@given(st.integers(0, 40), st.integers(0, 12), st.integers(1, 6))
def test_changed_since_is_the_union_of_the_rounds_fragments(held, ahead, count):
    version = held + ahead
    naive = sorted({(v - 1) % count for v in range(held + 1, version + 1)})
    assert changed_since(held, version, count) == naive


def test_too_many_fragments_is_a_config_error():
    with pytest.raises(ConfigError, match="fragments = 4, but the model has 3 arrays"):
        split_fragments(named([1, 2, 3]), 4)
    with pytest.raises(ConfigError, match="fragments must be >= 1"):
        split_fragments(named([1, 2, 3]), 0)
