"""Compute-time models: how long a site's local training takes in a simulated run.

A model gives seconds **per local step** on a site of speed 1; the virtual clock multiplies
one draw by the number of steps and divides by the site's speed. One draw per update (not
one per step) is deliberate: a straggler is slow for the whole update (a busy machine, a
thermal throttle), and a sum of independent per-step draws would average the tail away as
the number of steps grows.

Every model except ``measured`` has mean ``mean_seconds``, so switching the model changes
the shape of the delays but not the average speed of the federation.

==========================  =============================================================
model                       one draw (per step, before the speed factor)
==========================  =============================================================
``fixed``                   ``mean_seconds``, always
``exponential``             Exp with mean ``mean_seconds``
``shifted-exponential``     ``shift_seconds`` + Exp with mean ``mean_seconds - shift_seconds``
``pareto``                  classic Pareto, tail index ``pareto_shape`` = a > 1 and minimum
                            x_m = ``mean_seconds * (a - 1) / a`` (so its mean is
                            ``mean_seconds``)
``measured``                no draw: the time the site measured, divided by its speed
==========================  =============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flplatform.core.errors import ConfigError
from flplatform.network._values import fmt, is_number

COMPUTE_MODELS = ("fixed", "exponential", "shifted-exponential", "pareto", "measured")


@dataclass(frozen=True)
class ComputeModel:
    """The distribution of a site's compute time per local step, before its speed factor.

    Constructing a model does not validate it (so a loader can report every problem at
    once); see :meth:`problems`. A :class:`~flplatform.network.profiles.Network` validates
    its models when it is built.

    Parameters
    ----------
    kind : str
        One of :data:`COMPUTE_MODELS` (the TOML key is ``model``).
    mean_seconds : float
        Mean seconds per local step, > 0. Ignored by ``measured`` except for validation.
    shift_seconds : float
        ``shifted-exponential`` only: the least time a step can take, in [0, mean).
    pareto_shape : float
        ``pareto`` only: the tail index a > 1 (smaller means heavier stragglers; the
        variance is infinite for a <= 2).
    """

    kind: str = "exponential"
    mean_seconds: float = 0.05
    shift_seconds: float = 0.0
    pareto_shape: float = 3.0

    # --------------------------------------------------------------- validation
    def keyed_problems(self) -> list[tuple[str, str]]:
        """Return every problem as ``(key, message)``; keys are the TOML compute keys.

        A message reads as a sentence after its key, e.g. ``("mean_seconds", "must be a
        finite number > 0, got -1")``.
        """
        out: list[tuple[str, str]] = []
        if self.kind not in COMPUTE_MODELS:
            out.append(
                ("model", f"{fmt(self.kind)} is unknown; allowed: {', '.join(COMPUTE_MODELS)}")
            )
        mean = self.mean_seconds
        mean_ok = is_number(mean) and math.isfinite(mean) and mean > 0
        if not mean_ok:
            out.append(("mean_seconds", f"must be a finite number > 0, got {fmt(mean)}"))
        # shift and shape are checked only where they are used: a [defaults] shift must not
        # make an exponential site invalid just because its own mean is smaller.
        if self.kind == "shifted-exponential":
            shift = self.shift_seconds
            if not (is_number(shift) and math.isfinite(shift) and shift >= 0):
                out.append(("shift_seconds", f"must be a finite number >= 0, got {fmt(shift)}"))
            elif mean_ok and shift >= mean:
                out.append(
                    (
                        "shift_seconds",
                        f"must be < mean_seconds ({fmt(mean)}) for model "
                        f"'shifted-exponential', got {fmt(shift)}",
                    )
                )
        if self.kind == "pareto":
            shape = self.pareto_shape
            if not (is_number(shape) and math.isfinite(shape) and shape > 1):
                out.append(
                    (
                        "pareto_shape",
                        f"must be a finite number > 1 (the mean is infinite otherwise), "
                        f"got {fmt(shape)}",
                    )
                )
        return out

    def problems(self) -> list[str]:
        """Return one message per invalid field, each naming what is allowed; [] if valid."""
        return [f"{key} {message}" for key, message in self.keyed_problems()]

    def validate(self) -> None:
        """Raise ``ConfigError`` listing every problem, if there is any."""
        problems = self.problems()
        if problems:
            raise ConfigError("invalid compute model: " + "; ".join(problems))

    # ------------------------------------------------------------------ drawing
    @property
    def pareto_minimum_seconds(self) -> float:
        """The Pareto minimum x_m = mean (a - 1) / a, which makes the mean ``mean_seconds``."""
        return self.mean_seconds * (self.pareto_shape - 1.0) / self.pareto_shape

    def sample(self, rng: np.random.Generator) -> float | None:
        """Draw seconds per local step for one update; ``None`` for ``measured``.

        Parameters
        ----------
        rng : numpy.random.Generator
            The draw's generator, e.g. ``rng_for(seed, "compute", round, site)``, so the same
            seed gives the same delays.

        Raises
        ------
        ConfigError
            If the model is invalid.
        """
        self.validate()
        if self.kind == "fixed":
            return float(self.mean_seconds)
        if self.kind == "exponential":
            return float(rng.exponential(self.mean_seconds))
        if self.kind == "shifted-exponential":
            return self.shift_seconds + float(
                rng.exponential(self.mean_seconds - self.shift_seconds)
            )
        if self.kind == "pareto":
            # numpy draws Lomax (Pareto II, minimum 0); 1 + Lomax(a) is the classic Pareto
            # with minimum 1, scaled here to minimum x_m.
            return self.pareto_minimum_seconds * (1.0 + float(rng.pareto(self.pareto_shape)))
        return None  # measured: validate() has ruled out every other kind

    def expected(self) -> float | None:
        """Return the mean seconds per local step; ``None`` for ``measured``."""
        return None if self.kind == "measured" else float(self.mean_seconds)

    def to_dict(self) -> dict[str, Any]:
        """Return the model with the TOML compute keys (JSON-ready, loadable again)."""
        return {
            "model": self.kind,
            "mean_seconds": self.mean_seconds,
            "shift_seconds": self.shift_seconds,
            "pareto_shape": self.pareto_shape,
        }

    def describe(self) -> str:
        """Return a short human description, e.g. ``'pareto (a=3, mean 0.05 s/step)'``."""
        if self.kind == "measured":
            return "measured"
        mean = f"mean {fmt(self.mean_seconds)} s/step"
        if self.kind == "shifted-exponential":
            return f"shifted-exponential (shift {fmt(self.shift_seconds)} s, {mean})"
        if self.kind == "pareto":
            return f"pareto (a={fmt(self.pareto_shape)}, {mean})"
        return f"{self.kind} ({mean})"


def compute_seconds(
    model: ComputeModel,
    *,
    steps: int,
    speed: float,
    rng: np.random.Generator,
    measured: float | None,
) -> float | None:
    """Return a simulated update's compute time in seconds.

    ``steps * model.sample(rng) / speed``; for ``measured``, ``measured / speed`` (the
    measured time already covers every step), or ``None`` when nothing was measured.

    Parameters
    ----------
    model : ComputeModel
        The site's compute model.
    steps : int
        Local steps in the update, >= 0.
    speed : float
        The site's relative speed, finite and > 0 (2 is twice as fast as the host).
    rng : numpy.random.Generator
        Generator for the one draw this update makes.
    measured : float or None
        Seconds the update took on this machine, when known.

    Raises
    ------
    ValueError
        If ``steps``, ``speed`` or ``measured`` is out of range (a caller's bug: profiles
        are validated when they are loaded).
    ConfigError
        If the model is invalid.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be a finite number > 0, got {speed}")
    if model.kind == "measured":
        if measured is None:
            return None
        if not (math.isfinite(measured) and measured >= 0):
            raise ValueError(f"measured must be a finite number >= 0, got {measured}")
        return measured / speed
    per_step = model.sample(rng)
    if per_step is None:  # unreachable for a non-measured model; keeps the type honest
        return None
    return steps * per_step / speed
