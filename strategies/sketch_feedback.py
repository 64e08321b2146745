"""The maths of sketched aggregation beyond the sketch itself (pure torch).

FetchSGD's server state (``SketchFeedback``) and Sketched-SGD's candidate selection and site
accumulators (at the end of this module).

FetchSGD (ALGORITHMS.md §3; Rothchild et al., 2020): sites send count sketches S(g_n) of
their updates; the sketch is linear, so the server works on tables only:

    S   = Σ w_n S(g_n) / Σ w_n          (weighted mean of the sites' tables)
    S_u ← ρ·S_u + S                     (momentum, in sketch space)
    S_e ← S_e + η·S_u                   (error accumulation, in sketch space)
    Δ   = top-k of the estimates from S_e   (k coordinates and their estimated values)
    x   ← x + Δ

and then removes what it applied from the error, one of two ways:

* ``subtract`` (the paper): S_e ← S_e − S(Δ);
* ``zero`` (the authors' code, which reports the subtraction diverging): every bucket of
  S_e and S_u that S(Δ) touches is set to zero.

Learning rate: a site's update is its local-training delta g_n = x_n − x (its own lr
inside); η scales the momentum into the error (η = 1: plain averaging of the deltas when
the sketch is exact and k = d). Sign: x ← x + Δ because g_n is a delta, not a gradient.

Memory: two r × c tables, whatever the number of sites.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from flplatform.core.checks import require
from flplatform.core.errors import ConfigError
from strategies.count_sketch import CountSketch
from strategies.knobs import feedback_problems, k_problem


@dataclass
class SketchFeedback:
    """S_u and S_e of one run, and the rule that turns them into a k-sparse step.

    Parameters
    ----------
    sketch : CountSketch
        The hashes every site uses (same seed, rows, columns).
    k : int
        Coordinates applied per round.
    rho : float
        Momentum ρ in [0, 1).
    eta : float
        Server learning rate η > 0.
    removal : {"zero", "subtract"}
        How the applied step leaves the error (see the module docstring).
    excluded : tuple of (start, stop)
        Coordinate ranges never picked: arrays the sites leave out of their sketches
        (``strategies.averaged_arrays``), whose estimates are only other coordinates' noise.
    """

    sketch: CountSketch
    k: int
    rho: float = 0.9
    eta: float = 1.0
    removal: str = "zero"
    excluded: tuple[tuple[int, int], ...] = ()
    momentum: torch.Tensor | None = field(default=None, repr=False)  # S_u
    error: torch.Tensor | None = field(default=None, repr=False)  # S_e

    def __post_init__(self) -> None:
        require(
            k_problem(self.k), feedback_problems(rho=self.rho, eta=self.eta, removal=self.removal)
        )
        if self.k > self.sketch.d:
            raise ConfigError(f"k must be at most the model's {self.sketch.d} parameters")

    def step(
        self, mean_table: torch.Tensor, *, excluded: Sequence[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One round: fold the sites' mean table in and return Δ as (indices, values).

        ``indices`` are (k,) int64 ascending, ``values`` (k,) float32. ``excluded``: this
        round's coordinate ranges never picked, besides the run's own.
        """
        if self.momentum is None or self.error is None:
            self.momentum = self.sketch.zeros(mean_table.device)
            self.error = self.sketch.zeros(mean_table.device)
        elif self.momentum.device != mean_table.device:  # restored from a checkpoint
            self.momentum = self.momentum.to(mean_table.device)
            self.error = self.error.to(mean_table.device)
        self.momentum.mul_(self.rho).add_(mean_table)
        self.error.add_(self.momentum, alpha=self.eta)
        indices, values = self.sketch.top_k(
            self.error, self.k, excluded=(*self.excluded, *excluded)
        )
        order = torch.argsort(indices)
        indices, values = indices[order], values[order]
        if self.removal == "subtract":
            applied = torch.zeros(self.sketch.d, dtype=torch.float32, device=self.error.device)
            applied[indices] = values
            self.sketch.accumulate(self.error, -applied)
        else:
            rows = torch.arange(self.sketch.rows, device=self.error.device).view(-1, 1)
            buckets = self.sketch.buckets_of(indices)  # (r, k)
            self.error[rows, buckets] = 0.0
            self.momentum[rows, buckets] = 0.0
        return indices, values

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The two tables (empty before the first round)."""
        if self.momentum is None or self.error is None:
            return {}
        return {"momentum": self.momentum.clone(), "error": self.error.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from ``state_dict()``."""
        shape = (self.sketch.rows, self.sketch.cols)
        for name in ("momentum", "error"):
            table = state.get(name)
            if table is None or tuple(table.shape) != shape or not torch.isfinite(table).all():
                raise ConfigError(f"bad FetchSGD state: '{name}' must be a finite {shape} table")
        self.momentum = state["momentum"].to(torch.float32).clone()
        self.error = state["error"].to(torch.float32).clone()


# =================================================== Sketched-SGD (two rounds per step)
def candidate_coordinates(
    sketch: CountSketch,
    table: torch.Tensor,
    count: int,
    excluded: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """The ``count`` coordinates of largest estimated magnitude, ascending (int64), none in
    the ``excluded`` ranges (arrays sent whole) unless fewer than ``count`` others are
    nonzero.

    Sketched-SGD's first round: the server asks the sites for their exact values there.
    ``count >= d`` asks for every coordinate (the sketch is then not consulted at all).
    """
    if count >= sketch.d:
        return torch.arange(sketch.d, device=table.device)
    indices, _ = sketch.top_k(table, count, excluded=excluded)
    return torch.sort(indices).values


def exact_top_k(
    indices: torch.Tensor, values: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest |value| among (indices, values), ascending by index.

    Sketched-SGD's second round: ``values`` is the exact weighted sum of the sites' error
    accumulators at the candidate ``indices``; ties go to the lower coordinate.
    """
    if k >= len(indices):
        return indices, values
    # A stable sort on -|v| keeps candidates (ascending) in order among equal magnitudes.
    chosen = torch.sort(torch.argsort(-values.abs(), stable=True)[:k]).values
    return indices[chosen], values[chosen]


@dataclass
class SiteAccumulators:
    """One Sketched-SGD site's momentum u and error accumulation v (dense, d each).

    The site's mod builds them over its stored state's read-only bytes and only calls
    ``stepped``; ``add`` and ``zero`` change u and v in place, for accumulators the caller
    owns.

    Each step the site adds its update g (u ← m·u + g; v ← v + u) and sketches v; after the
    server applies a step the site's exact values went into, u and v are zeroed at the
    applied coordinates: what was applied leaves the error, and its momentum stops.
    """

    momentum: float
    u: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, d: int, momentum: float) -> SiteAccumulators:
        """Fresh accumulators for a model of d coordinates."""
        return cls(momentum, torch.zeros(d), torch.zeros(d))

    def add(self, update: torch.Tensor) -> None:
        """Fold this step's update in: u ← m·u + g; v ← v + u."""
        self.u.mul_(self.momentum).add_(update)
        self.v.add_(self.u)

    def zero(self, indices: torch.Tensor) -> None:
        """The server applied these coordinates with this site's values in them."""
        self.u[indices] = 0.0
        self.v[indices] = 0.0

    def is_finite(self) -> bool:
        """Whether u and v are finite: v = v_old + u with v_old finite, so v alone is read.

        By NumPy: ``torch.isfinite(v).all()`` on CPU takes about 15 times as long.
        """
        return bool(np.isfinite(self.v.cpu().numpy()).all())

    def stepped(self, update: torch.Tensor, zero: torch.Tensor | None) -> SiteAccumulators:
        """New accumulators: ``zero`` (if any) then ``add(update)``; self is only read.

        The same numbers as those two steps on copies, to the bit, in one pass that writes
        the new u and v: a site's stored accumulators are read-only views of its state.
        """
        u = torch.mul(self.u, self.momentum).add_(update)
        v = torch.add(self.v, u)
        if zero is not None and zero.numel():
            # as zero() then add(): u = 0·m + g and v = 0 + u there
            u[zero] = (
                torch.zeros(zero.numel(), dtype=u.dtype).mul_(self.momentum).add_(update[zero])
            )
            v[zero] = torch.zeros(zero.numel(), dtype=v.dtype).add_(u[zero])
        return SiteAccumulators(self.momentum, u, v)
