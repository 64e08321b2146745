"""Split a training set's indices among sites: IID or with Dirichlet label skew.

Every partitioner returns one sorted ``int64`` index array per site; together they cover every
example exactly once, and the split depends only on the labels, the number of partitions, the
scheme's parameters and ``seed`` (habit 5 of the style guide: randomness is a function of the
seed). The Dirichlet scheme follows Hsu, Qi and Brown, "Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification" (2019): for each class ``c`` draw site
proportions ``p_c ~ Dir(alpha)`` and split that class's shuffled examples accordingly; a small
``alpha`` gives each site few classes, a large ``alpha`` approaches IID.
"""

from __future__ import annotations

import numpy as np

from clients.catalog import PARTITION_SCHEMES
from flplatform.core.checks import check_int, check_positive, check_seed, integer, require
from flplatform.core.errors import ConfigError, DataError

__all__ = [
    "MAX_DIRICHLET_ATTEMPTS",
    "PARTITION_SCHEMES",
    "partition_dirichlet",
    "partition_iid",
    "partition_indices",
]


# Each attempt costs one pass over the labels; a hundred failures in a row mean the requested
# skew and minimum size are practically incompatible, and retrying longer would only hang.
MAX_DIRICHLET_ATTEMPTS = 100

# Tags mixed into the seed so each scheme draws from its own stream (see datasets._SPLIT_STREAM).
_IID_STREAM = 0x11D
_DIRICHLET_STREAM = 0xD112


def partition_iid(labels: np.ndarray, num_partitions: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle all indices and cut them into ``num_partitions`` near-equal parts.

    Parameters
    ----------
    labels : numpy.ndarray
        Integer labels ``(N,)``; only their number matters here.
    num_partitions : int
        Number of parts, ``1..N``.
    seed : int
        Seed of the shuffle.

    Returns
    -------
    list of numpy.ndarray
        Sorted ``int64`` indices; sizes differ by at most one (the first ``N % num_partitions``
        parts hold one more).

    Raises
    ------
    ConfigError
        If ``num_partitions`` or ``seed`` is out of range.
    DataError
        If ``labels`` is not a 1-D array of non-negative integers.
    """
    labels = _check_labels(labels)
    num_partitions = _check_num_partitions(num_partitions, len(labels))
    rng = np.random.default_rng([_IID_STREAM, check_seed(seed)])
    order = rng.permutation(len(labels)).astype(np.int64)
    return [np.sort(part) for part in np.array_split(order, num_partitions)]


def partition_dirichlet(
    labels: np.ndarray,
    num_partitions: int,
    *,
    alpha: float,
    seed: int,
    min_partition_size: int = 10,
) -> list[np.ndarray]:
    """Split indices with per-class proportions drawn from ``Dir(alpha)``.

    For each class, site proportions ``p ~ Dir(alpha * 1)`` are drawn and the class's shuffled
    indices are cut at ``floor(cumsum(p) * n_c)``. The whole draw is repeated, each attempt
    ``a`` with its own seed derived from ``(seed, a)``, until every partition holds at least
    ``min(min_partition_size, N // num_partitions)`` examples.

    Parameters
    ----------
    labels : numpy.ndarray
        Integer labels ``(N,)``.
    num_partitions : int
        Number of parts, ``1..N``.
    alpha : float
        Concentration, finite and > 0: small values give strong label skew.
    seed : int
        Seed of the draws.
    min_partition_size : int
        Wanted minimum size of every part (``>= 0``), capped at ``N // num_partitions`` so
        that it can always be met in principle.

    Returns
    -------
    list of numpy.ndarray
        Sorted ``int64`` indices, one array per partition.

    Raises
    ------
    ConfigError
        If a parameter is out of range.
    DataError
        If ``labels`` is malformed, or no draw in :data:`MAX_DIRICHLET_ATTEMPTS` attempts
        gives every partition its minimum size.
    """
    labels = _check_labels(labels)
    num_partitions = _check_num_partitions(num_partitions, len(labels))
    alpha = check_positive(alpha, name="alpha")
    seed = check_seed(seed)
    min_size = min(
        check_int(min_partition_size, name="min_partition_size", minimum=0),
        len(labels) // num_partitions,
    )
    by_class = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    concentration = np.full(num_partitions, alpha)
    smallest = 0
    for attempt in range(MAX_DIRICHLET_ATTEMPTS):
        rng = np.random.default_rng([_DIRICHLET_STREAM, seed, attempt])
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for members in by_class:
            shuffled = rng.permutation(members)
            proportions = rng.dirichlet(concentration)
            cuts = (np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
            for part, chunk in zip(parts, np.split(shuffled, cuts), strict=True):
                part.append(chunk)
        result = [np.sort(np.concatenate(part)).astype(np.int64) for part in parts]
        smallest = min(len(part) for part in result)
        if smallest >= min_size:
            return result
    raise DataError(
        f"no Dirichlet(alpha={alpha}) split of {len(labels)} examples into {num_partitions}"
        f" partitions gave each at least {min_size} examples in {MAX_DIRICHLET_ATTEMPTS}"
        f" attempts (last smallest: {smallest}); raise alpha, use fewer partitions or lower"
        " min_partition_size"
    )


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    *,
    scheme: str,
    alpha: float = 0.5,
    seed: int = 0,
    min_partition_size: int = 10,
) -> list[np.ndarray]:
    """Partition with the named scheme (one of :data:`PARTITION_SCHEMES`).

    Parameters
    ----------
    labels : numpy.ndarray
        Integer labels ``(N,)``.
    num_partitions : int
        Number of parts, ``1..N``.
    scheme : str
        ``"iid"`` or ``"dirichlet"``.
    alpha : float
        Dirichlet concentration; ignored by ``"iid"``.
    seed : int
        Seed of the split.
    min_partition_size : int
        Dirichlet's wanted minimum part size (see :func:`partition_dirichlet`); ignored by
        ``"iid"``, whose parts all hold ``N // num_partitions`` or one more.

    Returns
    -------
    list of numpy.ndarray
        Sorted ``int64`` indices, one array per partition.

    Raises
    ------
    ConfigError
        If the scheme is unknown or a parameter is out of range.
    DataError
        As raised by the chosen scheme.
    """
    if scheme == "iid":
        return partition_iid(labels, num_partitions, seed=seed)
    if scheme == "dirichlet":
        return partition_dirichlet(
            labels, num_partitions, alpha=alpha, seed=seed, min_partition_size=min_partition_size
        )
    raise ConfigError(
        f"unknown partition scheme {scheme!r}; allowed: {', '.join(PARTITION_SCHEMES)}"
    )


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "biu":
        raise DataError(
            f"labels must be a 1-D array of integers, got shape {labels.shape} of {labels.dtype}"
        )
    if labels.size == 0:
        raise DataError("labels is empty; partitioning needs at least one example")
    if labels.min() < 0:
        raise DataError(f"labels must be non-negative integers, found {labels.min()}")
    return labels


def _check_num_partitions(num_partitions: object, num_examples: int) -> int:
    require(
        integer(
            num_partitions,
            "num_partitions",
            minimum=1,
            maximum=num_examples,
            says=f"an integer in 1..{num_examples} (the number of examples)",
        )
    )
    return int(num_partitions)  # type: ignore[call-overload]
