"""Top-k selection and the integer type of coordinate indices on the wire.

Pure NumPy and torch; imports no Flower. Two selections, for two callers with different needs:

``top_k_by_magnitude``  NumPy, by |x_i|, indices sorted ascending, ties to the lower index:
                        deterministic across platforms, for the top-k codec's wire format.
``top_k_largest``       torch, by value, largest first (as ``torch.topk``): the k coordinates of
                        largest estimate in FetchSGD and Sketched-SGD, on any device.

Both first guess a threshold from a strided sample so that only about 2k candidates are
partitioned or sorted, and fall back to the whole vector when the guess is unsure; the result
never depends on the sample.
"""

from __future__ import annotations

import math

import numpy as np
import torch

INT32_LIMIT = 2**31  # indices into d >= 2^31 coordinates need int64
MAGNITUDE_SAMPLE = 1 << 16  # entries in top_k_by_magnitude's threshold sample
LARGEST_SAMPLE = 1 << 16  # entries in top_k_largest's threshold sample


def index_dtype(d: int) -> np.dtype[np.signedinteger]:
    """The integer type of coordinate indices into a model of d coordinates on the wire."""
    return np.dtype(np.int32 if d < INT32_LIMIT else np.int64)


def top_k_by_magnitude(x: np.ndarray, k: int, *, sample: int = MAGNITUDE_SAMPLE) -> np.ndarray:
    """Indices of the k entries of a 1-D ``x`` largest in magnitude, sorted ascending.

    Ties are broken by the lower index. O(d): with t the k-th largest |x_i| (one
    ``np.partition``), every i with |x_i| > t is selected (fewer than k of them) and the
    remaining places go to the lowest indices with |x_i| = t. This is deterministic, unlike
    ``np.argpartition``, whose choice among equal magnitudes depends on the algorithm.

    When k is small, a strided sample of ``sample`` entries first guesses a threshold g a
    little below t, and only the candidates |x_i| >= g are partitioned. If at least k
    candidates survive, t is among them, so the result is the same as without the sample;
    otherwise (an unlucky sample) the whole vector is partitioned.

    Returns
    -------
    np.ndarray
        (min(k, d),) int64.
    """
    d = x.size
    if k >= d:
        return np.arange(d, dtype=np.int64)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    a = np.abs(x)  # (d,)
    cand = _magnitude_candidates(a, k, sample)  # (c,) ascending, or None: all of [0, d)
    if cand is not None:
        a = a[cand]  # (c,)
    n = a.size
    t = np.partition(a, n - k)[n - k]  # k-th largest magnitude
    above = np.flatnonzero(a > t)  # (< k,)
    at = np.flatnonzero(a == t)[: k - above.size]  # ties at t, lowest indices first
    idx = np.concatenate([above, at]).astype(np.int64, copy=False)  # (k,)
    idx.sort(kind="stable")  # two ascending runs: timsort merges them in O(k)
    return idx if cand is None else cand[idx]


def _magnitude_candidates(a: np.ndarray, k: int, sample: int) -> np.ndarray | None:
    """Ascending indices of every |x_i| >= g, g guessed from a strided sample; None if unsure."""
    d = a.size
    stride = d // sample
    if stride < 2 or k > d // 8:
        return None  # the sample would not save much
    s = a[::stride]  # (m,)
    m = s.size
    # about k·m/d sample entries lie above t; aim 25% (+16) higher so the guess falls below t
    r = min(m, math.ceil(k * m / d * 1.25) + 16)
    guess = np.partition(s, m - r)[m - r]
    cand = np.flatnonzero(a >= guess)
    return cand if k <= cand.size <= d // 2 else None


def top_k_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor, largest first (as ``torch.topk``).

    ``torch.topk`` over millions of entries on CPU takes as long as sketching them. Here a
    strided sample sets a threshold with about 2k entries above it; one comparison pass keeps
    those, and ``torch.topk`` runs on them only. Exact: when at least k entries reach the
    threshold, every entry of the true top k is among them; otherwise (an unlucky sample)
    it falls back to ``torch.topk`` over everything. NaN entries never pass the threshold,
    so callers keep tables finite (the strategies reject non-finite uploads).
    """
    n = values.numel()
    if n <= LARGEST_SAMPLE or 4 * k > n:
        return torch.topk(values, k, sorted=True).indices
    sample = values[:: n // LARGEST_SAMPLE]  # strided view, deterministic
    m = sample.numel()
    expected_above = min(m - 1, 2 * k * m // n + 8)  # sample entries above the threshold
    threshold = torch.kthvalue(sample, m - expected_above).values
    candidates = torch.nonzero(values >= threshold).view(-1)  # (≈2k,) ascending
    if candidates.numel() < k:
        return torch.topk(values, k, sorted=True).indices
    return candidates[torch.topk(values[candidates], k, sorted=True).indices]
