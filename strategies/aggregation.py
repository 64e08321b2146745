"""Weighted averaging of site updates, streamed as replies arrive.

Pure NumPy; imports no Flower. The server never holds more than one accumulator the size
of the model, however many sites reply, so memory does not grow with sites × model size.

Symbols follow ALGORITHMS.md §1: site n sends a model x_n trained from the version x it
was sent, with n_n examples; Δ_n = x_n − x; the server applies
    Δ̄ = Σ w_n Δ_n / Σ w_n,   v ← β v + Δ̄,   x ← x + η_g v            (heavy ball, FedAvgM)
or, with Nesterov momentum (DiLoCo's outer step: −Δ̄ is its "outer gradient"),
    Δ̄ = Σ w_n Δ_n / Σ w_n,   v ← β v + Δ̄,   x ← x + η_g (Δ̄ + β v),
which is ``torch.optim.SGD(lr=η_g, momentum=β, nesterov=True)`` given the gradient −Δ̄;
or delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", as HALoS's reference code writes it, with its c = 0): the momentum moves every
N-th server step only, from the mean of the N steps' Δ̄ (an async server's steps each carry
a few sites' stale updates, and momentum over those compounds their staleness):
    P ← P + Δ̄;   every N-th step: v ← β v + P/N, P ← 0, x ← x + η_g (Δ̄/N + β v);
                 otherwise:                         x ← x + η_g Δ̄/N.
N = 1 is Nesterov momentum.
η_g = 1, β = 0 is plain FedAvg (the new model is the weighted mean of the site models).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from flplatform.core.errors import StepRefused

Arrays = dict[str, np.ndarray]


@dataclass
class WeightedDeltaSum:
    """Running Σ w_n Δ_n and Σ w_n in float64.

    float64 accumulation keeps the result independent of arrival order to well within
    float32 resolution, which is what the site models are stored in.
    """

    sums: Arrays = field(default_factory=dict)
    total_weight: float = 0.0
    count: int = 0
    # Memory for the sums where it fits (a spent sum's arrays): fresh pages cost more
    # than the arithmetic.
    into: Arrays = field(default_factory=dict)

    def add(
        self,
        delta: Mapping[str, np.ndarray],
        weight: float,
        scale: float = 1.0,
        *,
        spent: bool = False,
    ) -> None:
        """Add one site's delta: Σ += weight·scale·Δ, Σw += weight.

        ``weight`` (> 0) is the site's example count; ``scale`` (>= 0) discounts the update
        itself (e.g. 1/sqrt(1 + staleness)) without renormalising the discount away.
        ``spent``: the caller has no further use for ``delta``, whose float64 arrays are
        then scaled in place (a pass over memory saved; the sum is the same).
        """
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight}")
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {scale}")
        factor = weight * scale
        if self.count == 0:
            # into arrays, never a 0-d product: that is a NumPy scalar, not added into later
            self.sums = {
                k: np.multiply(v, factor, out=_memory(self.into.get(k), v), dtype=np.float64)
                for k, v in delta.items()
            }
            self.into = {}
        else:
            for key, value in delta.items():
                add_scaled(self.sums[key], value, factor, spent=spent)
        self.total_weight += weight
        self.count += 1

    def mean(self, *, spent: bool = False) -> Arrays:
        """Return Σ w_n Δ_n / Σ w_n (float64); an empty sum has no mean.

        ``spent``: the sum is not used again, and is divided in place (no model-sized copy).
        """
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError("no updates were accumulated")
        if spent:
            return {k: np.divide(v, self.total_weight, out=v) for k, v in self.sums.items()}
        return {k: v / self.total_weight for k, v in self.sums.items()}


# Elements per step of ``add_scaled``: a float64 block of 512 KiB stays in cache between
# the multiply and the add, so no model-sized temporary is made per update.
BLOCK = 1 << 16


def add_scaled(acc: np.ndarray, value: np.ndarray, factor: float, *, spent: bool = False) -> None:
    """``acc += np.multiply(value, factor, dtype=np.float64)``, the same numbers, block by
    block (``acc``: float64, ``value``: the same shape), or (``spent``: ``value`` is not
    needed after) with ``value`` scaled in place when it is a writable float64 array."""
    value = np.asarray(value)
    if spent and value.dtype == np.float64 and value.flags.writeable and value.shape == acc.shape:
        np.multiply(value, factor, out=value)
        acc += value
        return
    if not acc.flags.c_contiguous or value.shape != acc.shape:  # numpy's own way: a view
        acc += np.multiply(value, factor, dtype=np.float64)  # of acc could not be written
        return
    flat, values = acc.reshape(-1), value.reshape(-1)
    scratch = np.empty(min(BLOCK, flat.size), dtype=np.float64)
    for start in range(0, flat.size, BLOCK):
        part = flat[start : start + BLOCK]
        scaled = scratch[: part.size]
        np.multiply(values[start : start + BLOCK], factor, out=scaled, dtype=np.float64)
        part += scaled


def model_delta(
    received: np.ndarray, base: np.ndarray, *, out: np.ndarray | None = None
) -> np.ndarray:
    """Δ = x_n − x in float64: the numbers of ``received.astype(np.float64) - base``.

    Written into ``out`` when it can hold Δ (float64, C order, the shape: the memory of a
    spent Δ, as fresh pages cost more than the subtraction). ``base`` already in float64
    (``float64_model``) saves a cast per update: a subtraction of mixed types runs at
    half the speed.
    """
    if np.result_type(received, base, np.float64) != np.float64:  # complex: numpy's own way
        return received.astype(np.float64) - base
    delta = _memory(out, received)
    np.copyto(delta, received)
    np.subtract(delta, base, out=delta)
    return delta


def _memory(buffer: np.ndarray | None, like: np.ndarray) -> np.ndarray:
    """``buffer`` when it can hold a float64 copy of ``like`` (float64, C order, writable,
    the shape), else a new array for one."""
    if (
        buffer is not None
        and buffer.dtype == np.float64
        and buffer.shape == np.shape(like)
        and buffer.flags.c_contiguous
        and buffer.flags.writeable
    ):
        return buffer
    return np.empty(np.shape(like), dtype=np.float64)


def float64_model(
    arrays: Mapping[str, np.ndarray], *, into: Mapping[str, np.ndarray] | None = None
) -> Arrays:
    """The model x in float64 for ``model_delta``, in ``into``'s arrays where they fit (the
    last version's); arrays of other kinds (complex) are kept as they are, and
    ``model_delta`` promotes them as numpy would."""
    cast: Arrays = {}
    for key, value in arrays.items():
        if np.result_type(value, np.float64) != np.float64:
            cast[key] = value
            continue
        cast[key] = _memory((into or {}).get(key), value)
        np.copyto(cast[key], value)
    return cast


@dataclass
class ServerOptimizerState:
    """The server's own state: the momentum's velocity v (empty when β = 0); for delayed
    Nesterov, the Δ̄ summed since the momentum last moved (P) and the server steps taken."""

    velocity: Arrays = field(default_factory=dict)
    pending: Arrays = field(default_factory=dict)
    steps: int = 0


def apply_server_update(
    x: Mapping[str, np.ndarray],
    mean_delta: Mapping[str, np.ndarray],
    *,
    eta: float,
    beta: float,
    state: ServerOptimizerState,
    nesterov: bool = False,
    momentum_every: int = 1,
    spent: bool = False,
    x64: Mapping[str, np.ndarray] | None = None,
    averaged: Collection[str] = (),
) -> Arrays:
    """Return x + η_g·v with v ← β v + Δ̄ (FedAvgM; β = 0 is FedAvg), or with ``nesterov``
    x + η_g·(Δ̄ + β v): the step looks one velocity ahead; with ``momentum_every`` N > 1
    (Nesterov only), delayed Nesterov (see the module).

    The ``averaged`` arrays (buffers the training sets rather than learns:
    ``strategies.averaged_arrays``) become x + Δ̄, the sites' weighted mean, as FedAvg makes
    them: momentum and η_g would carry a running variance past its sites' values, below
    zero. Their velocity stays 0.

    The result keeps each array's dtype; integer arrays (e.g. a user model's BatchNorm
    counters) are rounded, since averaging them is all a model-agnostic server can do.
    ``spent``: ``mean_delta`` is not used again, and (β = 0) its float64 arrays hold the
    sums in float64 (the result's own arrays where x is float64), saving a model-sized
    allocation; ``x64``: x in float64 (``float64_model``), when the caller has it, saves a
    cast.

    Raises ``StepRefused`` if any array of the result would not be finite in its dtype
    (a float32 model overflows at 3.4e38); the state is then left as it was.
    """
    if momentum_every < 1 or (momentum_every > 1 and not (nesterov and beta > 0.0)):
        raise ValueError(
            f"momentum_every must be 1, or > 1 with Nesterov momentum (β > 0): {momentum_every}"
        )
    every = momentum_every
    due = (state.steps + 1) % every == 0  # the momentum moves at this step
    out: Arrays = {}
    velocity: Arrays = {}
    pending: Arrays = {}
    for key, base in x.items():
        step, rate = mean_delta[key], eta
        reuse = spent and _memory(step, step) is step  # Δ̄'s memory may hold the step
        if key in averaged:
            rate = 1.0
            # zeros, written when the others' are: the state holds the model's arrays in order
            if beta > 0.0 and due:
                velocity[key] = np.zeros(np.shape(step))
            if every > 1:
                pending[key] = np.zeros(np.shape(step))
        elif every > 1:
            held = state.pending.get(key)
            # a new array (never a 0-d NumPy scalar): ours to write
            held = step.copy() if held is None else np.add(held, step, out=np.empty_like(held))
            pending[key] = np.zeros_like(held) if due else held
            into = step if reuse else np.empty(np.shape(step))  # an array, even 0-d
            step = np.divide(step, every, out=into, dtype=np.float64)  # Δ̄/N
            if due:  # in held's memory, block by block: no model-sized temporaries
                held /= every  # P/N
                v = state.velocity.get(key)
                if v is not None:
                    add_scaled(held, v, beta)  # β·v + P/N
                velocity[key] = held
                add_scaled(step, held, beta)  # Δ̄/N + β·v
        elif beta > 0.0:
            v = state.velocity.get(key)
            v = step.copy() if v is None else beta * v + step
            velocity[key] = v
            # Nesterov: Δ̄ + β·v, in Δ̄'s memory when the caller is done with it
            step = np.add(step, beta * v, out=step if reuse else None) if nesterov else v
        real = np.result_type(base, np.float64) == np.float64
        unkept = beta == 0.0 or key in averaged or nesterov  # the step is not the velocity
        if spent and unkept and real and _memory(step, base) is step:
            new = step if rate == 1.0 else np.multiply(step, rate, out=step)  # 1·s is s
            np.add(new, base if x64 is None else x64[key], out=new)  # η·s + x is x + η·s
        else:
            new = np.array(base, dtype=np.float64)
            add_scaled(new, step, rate)  # x + η·step, without a model-sized η·step
        if base.dtype.kind in "biu":  # integers and bools: rounded to the nearest
            if not np.isfinite(new).all():
                raise StepRefused(f"array '{key}' would become non-finite")
            new = np.rint(new)
            if base.dtype.kind == "b":  # on where the sites' mean rounds to 1 (astype(bool)
                new = np.clip(new, 0, 1)  # turned any nonzero mean on)
            else:
                # beyond the dtype, a cast wraps round (1e30 in int64 is -2^63) without a
                # word; float(max) + 1 is the first value out of range, whichever rounds it
                info = np.iinfo(base.dtype)
                if new.size and (new.min() < info.min or new.max() >= float(info.max) + 1):
                    raise StepRefused(
                        f"array '{key}' would leave {base.dtype}'s range [{info.min}, {info.max}]"
                    )
        with np.errstate(over="ignore"):  # overflow is what the check below looks for
            cast = new.astype(base.dtype, copy=False)
        if np.issubdtype(cast.dtype, np.inexact) and not np.isfinite(cast).all():
            raise StepRefused(f"array '{key}' would become non-finite in {base.dtype}")
        out[key] = cast
    state.velocity.update(velocity)
    state.pending.update(pending)
    state.steps += 1
    return out


def weighted_average(models: list[Mapping[str, np.ndarray]], weights: list[float]) -> Arrays:
    """Σ w_n x_n / Σ w_n of whole models, through the streaming path (x = first model).

    Used where a batch of models must be averaged (Flower's ``aggregate_train`` hook).
    """
    if not models:
        raise ValueError("no models to average")
    base = models[0]
    acc = WeightedDeltaSum()
    for model, weight in zip(models, weights, strict=True):
        acc.add({k: np.asarray(model[k], np.float64) - base[k] for k in base}, weight)
    return apply_server_update(base, acc.mean(), eta=1.0, beta=0.0, state=ServerOptimizerState())
