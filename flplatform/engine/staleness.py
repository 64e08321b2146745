"""Staleness weights: how much a stale update counts when it is aggregated.

Pure maths (no Flower, no torch). A weight w ∈ (0, 1] multiplies the update's example
weight in Σ nᵢ·wᵢ·Δᵢ / Σ nᵢ, so a discount really shortens the step.

* ``none``: every update counts fully.
* ``sqrt``: w = 1/√(1 + s) for staleness s (FedBuff, Nguyen et al. 2022).
* ``step``: the staleness-dependent learning rate of Dutta et al. ("Slow and Stale Gradients
  Can Win the Race", 2018), η_j = min(C / ‖x_j − x_τ(j)‖², η_max) with η_max the server's
  learning rate: w = min(1, C / ‖x_j − x_τ‖²), where x_j is the current model and x_τ the
  version the update was computed on. A fresh update (x_j = x_τ) counts fully.
"""

from __future__ import annotations

import math
from collections.abc import Callable

WEIGHTINGS = ("none", "sqrt", "step")


def staleness_weight(
    weighting: str,
    staleness: int,
    *,
    distance_sq: Callable[[], float] | None = None,
    c: float = 1.0,
) -> float:
    """The weight of an update with ``staleness`` under ``weighting``.

    Parameters
    ----------
    weighting : {"none", "sqrt", "step"}
        The rule (see the module docstring).
    staleness : int
        Model versions between the one the update was computed on and the current one.
    distance_sq : callable, optional
        Returns ‖x_current − x_τ‖² (only called for ``step`` with staleness > 0, since
        computing it touches every parameter).
    c : float
        The constant C of the ``step`` rule.

    Returns
    -------
    float
        A weight in (0, 1].
    """
    if weighting == "none" or staleness <= 0:
        return 1.0
    if weighting == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if weighting == "step":
        if distance_sq is None:
            raise ValueError("the 'step' weighting needs the model distance")
        distance = distance_sq()
        if not math.isfinite(distance):
            return 1e-12  # a diverged model: the stale update barely counts
        return 1.0 if distance <= c else max(c / distance, 1e-12)
    raise ValueError(f"unknown staleness weighting {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")


def adasync_k(k0: int, *, initial_loss: float | None, loss: float | None, k_max: int) -> int:
    """AdaSync's K for the next step: K₀·√(F(x₀)/F(x_t)), between K₀ and ``k_max``.

    As the loss falls, waiting for more updates lowers the error floor (Dutta et al.,
    §6). Losses that are missing, non-positive or non-finite leave K at K₀.
    """
    if (
        initial_loss is None
        or loss is None
        or not (math.isfinite(initial_loss) and math.isfinite(loss))
        or initial_loss <= 0
        or loss <= 0
    ):
        return max(1, min(k0, k_max))
    return max(1, min(k_max, max(k0, round(k0 * math.sqrt(initial_loss / loss)))))
