"""How far a site's features are from unit scale, and standardising them at the site.

Raw tabular features (a price in dollars beside a ratio) make SGD's first steps huge: the
loss of scikit-learn's unscaled wine data reaches 1e5 in one round. Each site can
standardise its own features with the mean and standard deviation of its own training
split; the statistics stay at the site (the server and the other sites never see them),
and nothing is computed on held-out data. Pure NumPy, no Flower.
"""

from __future__ import annotations

import numpy as np

__all__ = ["feature_scale", "standardize"]


def standardize(train: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    """Standardise ``train`` and ``others`` with the per-feature statistics of ``train`` alone.

    A feature is one position of an example (a pixel of ``(C, H, W)``, a column of a
    one-row image): every value there gets ``(x - mean) / std`` with the mean and the
    population standard deviation over ``train``'s examples. A feature constant in
    ``train`` (std 0) is centred and not divided, so it stays finite (0 in ``train``).

    Parameters
    ----------
    train : numpy.ndarray
        ``(N, ...)`` training examples, N >= 1; the only data the statistics come from.
    *others : numpy.ndarray
        ``(M, ...)`` arrays of the same example shape (the site's validation slice),
        transformed with ``train``'s statistics; M may be 0.

    Returns
    -------
    tuple of numpy.ndarray
        ``float32`` copies: ``train`` standardised, then each of ``others``.
    """
    # float64: the mean of a constant float32 feature is then exact, so its std is exactly
    # 0 and it is recognised as constant rather than divided by rounding noise.
    values = train.astype(np.float64)
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    std[std == 0] = 1.0
    return tuple(
        ((array.astype(np.float64) - mean) / std).astype(np.float32) for array in (train, *others)
    )


def feature_scale(x: np.ndarray) -> float:
    """The largest per-feature root-mean-square value of ``x`` (0.0 without examples).

    RMS, not the standard deviation: a feature far from zero (a year, 2024 ± 3) is as
    far from unit scale for SGD as a widely spread one. Unit-scale data (pixels in
    [0, 1], standardised features) gives about 1; scikit-learn's wine gives 810 (proline).
    """
    if len(x) == 0:
        return 0.0
    rms = np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=0))
    return float(rms.max())
