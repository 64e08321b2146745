"""Top-k selection and the integer type of coordinate indices on the wire.

Pure NumPy; imports no Flower and no torch (the top-k codec's spec is parsed where torch is
not loaded). ``top_k_by_magnitude`` selects by |x_i|, indices sorted ascending, ties to the
lower index: deterministic across platforms, for the top-k codec's wire format. (Its torch
sibling on any device, by value, is ``strategies.count_sketch.top_k_largest``.)

It first guesses a threshold from a strided sample so that only about 2k candidates are
partitioned, and falls back to the whole vector when the guess is unsure; the result never
depends on the sample.
"""

from __future__ import annotations

import math

import numpy as np

INT32_LIMIT = 2**31  # indices into d >= 2^31 coordinates need int64
MAGNITUDE_SAMPLE = 1 << 16  # entries in top_k_by_magnitude's threshold sample


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
