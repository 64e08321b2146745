"""Centred clipping: a robust mean that bounds how far one update can pull a round.

Pure NumPy; imports no Flower. Karimireddy, He and Jaggi, "Learning from History for
Byzantine Robust Optimization" (ICML 2021), in the form that streams: with the centre c
(the last step's Δ̄, zero before the first) and a radius τ,

    Δ̄ = c + Σ w_n α_n (Δ_n − c) / Σ w_n,   α_n = min(1, τ / ‖Δ_n − c‖),

a single clipping iteration from the previous aggregate, which the paper found enough in
practice. Each update is clipped as it arrives, so the server still holds
one model-sized sum, not the round's updates (the median and the trimmed mean hold them).

τ is ``radius`` times the median distance ‖Δ_n − c‖ (before clipping) of the updates of
this round so far, Δ_n's own counted, and of the ``window_rounds`` − 1 rounds with updates
before it (as the update guard's norm window, this round counted): it follows training as
updates shrink, and no fewer than half of the recent updates stand inside it, so a
minority of attackers cannot stretch it. Until ``min_reference`` distances
are known (the first updates of a run) nothing is clipped; the update guard's norm bound
still applies.

Arrays that the sites' data sets rather than their training moves (``skip``: BatchNorm's
running statistics and counters, ``strategies.averaged_arrays``) keep the plain weighted
mean, and count neither in the distance nor in the centre: clipped towards the last step
they would stop being the sites' mean (a running variance could turn negative).

What it bounds: whatever an update holds, it moves the round's mean by at most
w_n·τ/Σ w from the centre, and in the direction it chooses only that far, so a site that
scales its update or flips its sign weighs no more than an honest site at the median
distance. What it cannot stop: an attacker that stays inside τ (ALIE's small shifts, IPM
with a small ε) or that holds half the weight; and an honest site whose data differs from
everyone's (the slowest site in k-sync) is pulled towards the centre too, and counts
less while it does.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]


def _squared_norm(part: np.ndarray) -> float:
    flat = part.reshape(-1)
    return float(np.vdot(flat, flat).real)  # |z|², for complex arrays too


@dataclass
class CenteredClip:
    """The centre, the recent distances and the radius rule (see the module).

    ``clip`` turns an update into its offset from the centre, Δ_n − c, in place, and says
    the factor α_n it counts with; ``recentre`` turns the weighted mean of the clipped
    offsets into the round's Δ̄, ``propose`` keeps it, and ``end_round`` makes it the
    centre once the step it made was taken.
    """

    radius: float = 1.0
    window_rounds: int = 3
    min_reference: int = 3
    skip: frozenset[str] = frozenset()  # arrays that keep the plain mean (see the module)
    center: Arrays = field(default_factory=dict)  # empty: c = 0 (no step taken yet)
    past: deque[list[float]] = field(default_factory=deque)  # distances of past rounds
    current: list[float] = field(default_factory=list)  # this round's so far
    _proposed: Arrays = field(default_factory=dict, repr=False)
    _sorted: list[float] = field(default_factory=list, repr=False)  # past and current

    def __post_init__(self) -> None:
        self.past = deque(self.past, maxlen=self.window_rounds - 1)
        self._sorted = sorted([d for past in self.past for d in past] + self.current)

    def _forget_current(self) -> None:
        """This round's distances out of the reference (the past rounds' stay)."""
        self.current = []
        self._sorted = sorted(d for past in self.past for d in past)

    def begin_round(self) -> None:
        """Forget the distances of a round that never finished."""
        if self.current:
            self._forget_current()

    def reference(self) -> float | None:
        """τ / radius: the median recent distance, or None while too few are known."""
        known, count = self._sorted, len(self._sorted)
        if count < self.min_reference:
            return None
        middle = count // 2  # the mean of the middle two for an even count
        return known[middle] if count % 2 else (known[middle - 1] + known[middle]) / 2

    def clip(self, delta: Mapping[str, np.ndarray]) -> float:
        """Write Δ_n − c into ``delta``'s arrays (float64, the caller's to change; those in
        ``skip`` are left as they are) and return α_n = min(1, τ/‖Δ_n − c‖), the factor
        the offset counts with (``shrink`` applies it where ``skip`` must stay whole)."""
        total = 0.0
        for key, part in delta.items():
            if key in self.skip:
                continue
            kept = self.center.get(key)
            if kept is not None:
                np.subtract(part, kept, out=part)
            total += _squared_norm(part)
        distance = math.sqrt(total)
        self.current.append(distance)  # counted in its own reference, as the round's others
        bisect.insort(self._sorted, distance)
        reference = self.reference()
        if reference is None or distance <= self.radius * reference:
            return 1.0
        return self.radius * reference / distance

    def shrink(self, offset: Mapping[str, np.ndarray], alpha: float) -> None:
        """Scale the clipped arrays of an offset by ``alpha`` in place (not ``skip``'s)."""
        for key, part in offset.items():
            if key not in self.skip:
                np.multiply(part, alpha, out=part)

    def note(self, alpha: float) -> str | None:
        """The ledger's note on the update ``clip`` just gave ``alpha`` (None: whole)."""
        if alpha >= 1.0:
            return None
        distance = self.current[-1]
        counted = math.floor(alpha * 1000) / 1000  # never "x1" for a clipped update
        return (
            f"centered-clip: offset {distance:.4g} from the last step > radius "
            f"{alpha * distance:.4g}: counted x{counted:.3f}"
        )

    def recentre(self, mean_offset: Arrays) -> Arrays:
        """Δ̄ = c + the weighted mean of the clipped offsets, in ``mean_offset``'s arrays."""
        for key, part in mean_offset.items():
            kept = self.center.get(key)
            if kept is not None:
                np.add(part, kept, out=part)
        return mean_offset

    def propose(self, mean: Mapping[str, np.ndarray]) -> None:
        """Keep a copy of the round's Δ̄ (in the memory of the centre before last): the next
        centre once its step is taken (the server step may write into ``mean``)."""
        for key, part in mean.items():
            if key in self.skip:
                continue
            spare = self._proposed.get(key)
            if spare is None or spare.shape != np.shape(part):
                self._proposed[key] = np.array(part, dtype=np.float64)
            else:
                np.copyto(spare, part)

    def end_round(self, *, stepped: bool) -> None:
        """Close the round: its distances join the window (a round without updates leaves
        it as it was) and, when its step was taken (``stepped``), the Δ̄ ``propose`` kept
        becomes the centre."""
        if self.current:
            self.past.append(self.current)
        self._forget_current()
        if stepped and self._proposed:
            self.center, self._proposed = self._proposed, self.center

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The centre and the distances of past rounds (copies)."""
        return {
            "center": {k: v.copy() for k, v in self.center.items()},
            "distances": [list(d) for d in self.past],
        }

    def restore(self, center: Arrays, distances: list[list[float]]) -> None:
        """Set what ``state_dict`` saved (checked by the caller)."""
        self.center = {k: np.array(v, dtype=np.float64) for k, v in center.items()}
        self.past = deque((list(d) for d in distances), maxlen=self.window_rounds - 1)
        self._proposed = {}
        self._forget_current()

    def misfits(self, model: Mapping[str, np.ndarray]) -> list[str]:
        """How a restored centre does not fit ``model``'s clipped arrays (names, shapes)."""
        if not self.center:
            return []
        wanted = [k for k in model if k not in self.skip]
        if list(self.center) != wanted:
            return [f"'center' holds arrays {list(self.center)[:6]}, this run's model {wanted[:6]}"]
        return [
            f"'center.{k}' has shape {v.shape}, this run needs {np.shape(model[k])}"
            for k, v in self.center.items()
            if v.shape != np.shape(model[k])
        ]
