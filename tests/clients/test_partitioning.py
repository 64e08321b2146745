"""Tests of clients.partitioning: coverage, determinism, sizes, skew and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.partitioning import (
    PARTITION_SCHEMES,
    partition_dirichlet,
    partition_iid,
    partition_indices,
)
from flplatform.core.errors import ConfigError, DataError


@st.composite
def labels_and_partitions(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    num_classes = draw(st.integers(1, 12))
    labels = draw(st.lists(st.integers(0, num_classes - 1), min_size=1, max_size=300))
    num_partitions = draw(st.integers(1, min(len(labels), 20)))
    return np.array(labels, dtype=np.int64), num_partitions


seeds = st.integers(0, 2**32)
alphas = st.floats(0.05, 100.0)


def assert_exact_cover(parts: list[np.ndarray], num_examples: int, num_partitions: int) -> None:
    assert len(parts) == num_partitions
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0)  # sorted, no repeats within a part
    # Every index 0..N-1 exactly once across all parts.
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(num_examples))


@settings(max_examples=60, deadline=None)
@given(labels_and_partitions(), seeds)
def test_iid_covers_exactly_balanced_and_deterministic(case, seed: int) -> None:
    labels, num_partitions = case
    parts = partition_iid(labels, num_partitions, seed=seed)
    assert_exact_cover(parts, len(labels), num_partitions)
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    again = partition_iid(labels, num_partitions, seed=seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=60, deadline=None)
@given(labels_and_partitions(), seeds, alphas)
def test_dirichlet_covers_exactly_and_deterministic(case, seed: int, alpha: float) -> None:
    labels, num_partitions = case
    # min_partition_size=0: coverage must hold for every draw, not only accepted ones.
    parts = partition_dirichlet(
        labels, num_partitions, alpha=alpha, seed=seed, min_partition_size=0
    )
    assert_exact_cover(parts, len(labels), num_partitions)
    again = partition_dirichlet(
        labels, num_partitions, alpha=alpha, seed=seed, min_partition_size=0
    )
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=40, deadline=None)
@given(labels_and_partitions(), seeds, st.floats(0.3, 100.0), st.integers(0, 15))
def test_dirichlet_minimum_size_is_met_or_refused(
    case, seed: int, alpha: float, min_size: int
) -> None:
    labels, num_partitions = case
    try:
        parts = partition_dirichlet(
            labels, num_partitions, alpha=alpha, seed=seed, min_partition_size=min_size
        )
    except DataError as error:
        assert "raise alpha" in error.reason
        return
    assert_exact_cover(parts, len(labels), num_partitions)
    assert min(len(part) for part in parts) >= min(min_size, len(labels) // num_partitions)


def test_iid_golden_case() -> None:
    # Derived by running it once, then checked by hand: with seed 0 the shuffle of 0..9 is
    # [9 8 2 6 5 7 3 4 1 0]; array_split cuts it 4|3|3 and each part is sorted. The parts are
    # disjoint and together hold 0..9 once each: a permutation split.
    parts = partition_iid(np.zeros(10, dtype=np.int64), 3, seed=0)
    expected = [[2, 6, 8, 9], [3, 5, 7], [0, 1, 4]]
    assert [part.tolist() for part in parts] == expected


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_different_seeds_give_different_splits(scheme: str) -> None:
    labels = np.repeat(np.arange(5), 40)
    splits = {
        tuple(tuple(part) for part in partition_indices(labels, 4, scheme=scheme, seed=seed))
        for seed in range(10)
    }
    assert len(splits) == 10


def test_partition_indices_dispatches_to_the_scheme() -> None:
    labels = np.repeat(np.arange(4), 25)
    iid = partition_indices(labels, 3, scheme="iid", seed=5)
    for got, want in zip(iid, partition_iid(labels, 3, seed=5), strict=True):
        np.testing.assert_array_equal(got, want)
    skewed = partition_indices(labels, 3, scheme="dirichlet", alpha=0.3, seed=5)
    for got, want in zip(skewed, partition_dirichlet(labels, 3, alpha=0.3, seed=5), strict=True):
        np.testing.assert_array_equal(got, want)


def mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    entropies = []
    for part in parts:
        counts = np.bincount(labels[part], minlength=10)
        share = counts[counts > 0] / counts.sum()
        entropies.append(float(-(share * np.log(share)).sum()))
    return float(np.mean(entropies))


def test_small_alpha_is_more_skewed_than_large_alpha() -> None:
    labels = np.repeat(np.arange(10), 100)

    def skew(alpha: float) -> float:
        return float(
            np.mean(
                [
                    mean_label_entropy(labels, partition_dirichlet(labels, 5, alpha=alpha, seed=s))
                    for s in range(20)
                ]
            )
        )

    small, medium, large = skew(0.1), skew(1.0), skew(100.0)
    # Measured: about 1.13, 2.01 and 2.30 nats; log(10) = 2.30 is a uniform label mix.
    assert small < medium - 0.5
    assert medium < large - 0.1
    assert large > 0.97 * np.log(10)


def test_dirichlet_with_large_alpha_splits_each_class_evenly() -> None:
    labels = np.repeat(np.arange(3), 1000)
    parts = partition_dirichlet(labels, 4, alpha=1e6, seed=0)
    counts = np.array([np.bincount(labels[part], minlength=3) for part in parts])
    np.testing.assert_allclose(counts, 250, atol=5)


def test_dirichlet_impossible_minimum_raises_data_error() -> None:
    # 20 examples of one class into 20 partitions needs a draw giving each exactly one; with
    # alpha = 0.001 nearly all mass lands on one partition, so no attempt succeeds.
    with pytest.raises(DataError, match="raise alpha, use fewer partitions"):
        partition_dirichlet(np.zeros(20, dtype=np.int64), 20, alpha=1e-3, seed=0)


@pytest.mark.parametrize("num_partitions", [0, -1, 11, 2.5, True, "3"])
@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_bad_num_partitions(num_partitions: object, scheme: str) -> None:
    with pytest.raises(ConfigError, match=r"num_partitions must be an integer in 1\.\.10"):
        partition_indices(np.zeros(10, dtype=np.int64), num_partitions, scheme=scheme)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf"), "0.5", None])
def test_bad_alpha(alpha: object) -> None:
    with pytest.raises(ConfigError, match="alpha must be a finite number > 0"):
        partition_indices(np.zeros(10, dtype=np.int64), 2, scheme="dirichlet", alpha=alpha)  # type: ignore[arg-type]


def test_iid_ignores_alpha() -> None:
    parts = partition_indices(np.zeros(10, dtype=np.int64), 2, scheme="iid", alpha=-1.0)
    assert len(parts) == 2


def test_unknown_scheme_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="allowed: iid, dirichlet"):
        partition_indices(np.zeros(10, dtype=np.int64), 2, scheme="non-iid")


@pytest.mark.parametrize("seed", [-1, 1.0, 2**63])
def test_bad_seed(seed: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        partition_iid(np.zeros(10, dtype=np.int64), 2, seed=seed)  # type: ignore[arg-type]


def test_bad_min_partition_size() -> None:
    with pytest.raises(ConfigError, match="min_partition_size"):
        partition_dirichlet(
            np.zeros(10, dtype=np.int64), 2, alpha=1.0, seed=0, min_partition_size=-1
        )


@pytest.mark.parametrize(
    "labels",
    [np.zeros((4, 2), dtype=np.int64), np.array([0.0, 1.0]), np.array([0, -1]), np.array([], int)],
)
def test_bad_labels(labels: np.ndarray) -> None:
    with pytest.raises(DataError, match="labels"):
        partition_iid(labels, 1, seed=0)
