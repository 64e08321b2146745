"""Site codecs: compress a model update for upload, with error feedback.

Pure NumPy; imports no Flower. ALGORITHMS.md §5: per-site codecs with a residual, measured
by their bytes on the wire. A codec maps an update u (a dict name → array) to *wire arrays*
(what is actually sent) and back::

    wire = codec.encode(u, rng=rng)           # on the site
    û    = codec.decode(wire, layout)         # on the server (and on the site, for feedback)

Codecs
------
``TopK``            global top-k by |u_i| over the flattened update; k indices + k values.
``StochasticInt8``  per array, s = max|x|, q = SR(127·x/s) ∈ [−127, 127] int8; û = q·s/127,
                    unbiased: E[û] = x.
``StochasticInt4``  per block of 64 elements, s = max|x|, q = SR(7·x/s) ∈ [−7, 7], two codes
                    a byte; û = q·s/7, unbiased (4.5 bits an element with the scales).
``Identity``        the arrays themselves.

Top-k, int8 and int4 compress the weights only: a layout's running statistics and integer
arrays (``Layout.averaged``, by ``strategies.averaged_arrays``' rule) travel exactly,
concatenated per carrier dtype (``averaged/float32``, ``averaged/float64``), and their
residual holds only the rounding to their dtypes. A compressed running variance can turn
negative on the server.

Error feedback (Seide et al. 2014; Stich et al., "Sparsified SGD with Memory", 2018; Karimireddy
et al., "Error Feedback Fixes SignSGD", 2019) keeps what the codec dropped and sends it later::

    v_t = u_t + e_{t−1},   ŝ_t = decode(encode(v_t)),   e_t = v_t − ŝ_t

so Σ_t ŝ_t + e_T = Σ_t u_t: nothing is lost, only delayed.

Wire input comes from a possibly hostile site: ``decode`` checks every key, dtype, shape,
length, index and value against the server's own ``Layout`` and raises ``UpdateRejected``
naming the problem; nothing it returns can be larger than the model or non-finite.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from flplatform.core.errors import ConfigError, UpdateRejected
from strategies.averaged_arrays import AVERAGED, pack, packed_keys, unpack
from strategies.layout import Arrays, Layout
from strategies.top_k import index_dtype, top_k_by_magnitude

Wire = dict[str, np.ndarray]

TOPK_INDICES = "topk.indices"
TOPK_VALUES = "topk.values"
INT8_PREFIX = "int8."
SCALE_SUFFIX = ".scale"
RAW_PREFIX = "raw."
RESIDUAL_PREFIX = "residual."
INT8_LEVELS = 127  # q ∈ [−127, 127]: symmetric, so −x encodes as −q (−128 is never sent)
INT4_PREFIX = "int4."
INT4_LEVELS = 7  # q ∈ [−7, 7], sent as the nibble q + 8: code 0 (q = −8) is never sent
INT4_ZERO = 8  # the nibble of q = 0, also the padding of an odd-length array's last byte
INT4_BLOCK = 64  # elements per scale: a float32 scale adds half a bit per element
# Elements quantized at a time (whole int4 blocks, an even count); results do not depend on it.
# Large enough that numpy's cost per call (a chunk takes about twenty) is small beside the
# work, small enough that a chunk's float64 buffers stay in cache.
QUANT_CHUNK = 1 << 15
CODEC_SPECS = "'none', 'int8', 'int4', 'topk:<k>' (an integer >= 1) or 'topk:<fraction>' in (0, 1]"


# ---------------------------------------------------------------------------- codec protocol
class Codec(Protocol):
    """Compression of one site's update for upload.

    ``encode`` returns the wire arrays (what is sent); ``decode`` rebuilds the dense update
    in the layout's dtypes and rejects malformed wire input with ``UpdateRejected``.
    ``name`` is the spec ``make_codec`` parses back into the same codec. ``averaged``:
    the arrays the user named to travel exactly (``Layout.named_averaged``), which both
    halves must know alike: the server names them in its training messages.
    """

    @property
    def name(self) -> str: ...

    @property
    def averaged(self) -> tuple[str, ...]: ...

    def encode(self, update: Mapping[str, np.ndarray], *, rng: np.random.Generator) -> Wire: ...

    def decode(self, wire: Mapping[str, np.ndarray], layout: Layout) -> Arrays: ...


def wire_nbytes(wire: Mapping[str, np.ndarray]) -> int:
    """Σ nbytes of the wire arrays (payload only; the ledger measures serialized bytes)."""
    return sum(int(np.asarray(a).nbytes) for a in wire.values())


# ---------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class Identity:
    """No compression: the wire is each array itself under ``raw.<name>``."""

    averaged: tuple[str, ...] = ()  # every array travels exactly

    @property
    def name(self) -> str:
        """Spec of this codec."""
        return "none"

    def encode(self, update: Mapping[str, np.ndarray], *, rng: np.random.Generator) -> Wire:
        """Copies of the arrays (``rng`` is unused)."""
        layout = Layout.of(update)
        _require_finite(update)
        return {RAW_PREFIX + n: np.array(update[n]) for n in layout.names}

    def decode(self, wire: Mapping[str, np.ndarray], layout: Layout) -> Arrays:
        """Check each ``raw.<name>`` against the layout and return copies."""
        _check_keys(wire, {RAW_PREFIX + n for n in layout.names}, self.name)
        return {n: _raw_array(wire, n, layout).copy() for n in layout.names}


# ---------------------------------------------------------------------------- top-k
@dataclass(frozen=True)
class TopK:
    """Global top-k sparsification of the flattened update.

    Parameters
    ----------
    k : int, optional
        Number of coordinates sent, >= 1; capped at d.
    fraction : float, optional
        Fraction of the d coordinates sent, in (0, 1]: k = max(1, round(fraction·d)).

    Exactly one of ``k`` and ``fraction`` is given.

    Notes
    -----
    Wire: ``topk.indices`` (k,) int32 (int64 when d >= 2^31), strictly increasing, and
    ``topk.values`` (k,) float32, the update at those indices. Coordinates run over the
    arrays in ``Layout`` order (sorted names); the ``Layout.averaged`` arrays are never
    selected (a zero there is picked only when fewer than k others are nonzero) and travel
    exactly beside (``averaged/<dtype>``). Selection is deterministic
    (``strategies.top_k.top_k_by_magnitude``); ``rng`` is unused. Biased: use with
    ``ErrorFeedback``.
    """

    k: int | None = None
    fraction: float | None = None
    averaged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.k is None) == (self.fraction is None):
            raise ConfigError("top-k needs exactly one of k (a count) and fraction (of d)")
        if self.k is not None and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1
        ):
            raise ConfigError(f"top-k k must be an integer >= 1, got {self.k!r}")
        if self.fraction is not None and (
            isinstance(self.fraction, bool)
            or not isinstance(self.fraction, int | float)
            or not 0.0 < self.fraction <= 1.0
        ):
            raise ConfigError(f"top-k fraction must be in (0, 1], got {self.fraction!r}")

    @property
    def name(self) -> str:
        """Spec of this codec: ``topk:<k>`` or ``topk:<fraction>``."""
        return f"topk:{self.k}" if self.k is not None else f"topk:{float(self.fraction or 0)!r}"

    def k_for(self, d: int) -> int:
        """Number of coordinates sent for a d-dimensional update."""
        if self.k is not None:
            return min(self.k, d)
        assert self.fraction is not None  # __post_init__ guarantees one of them
        return min(d, max(1, round(self.fraction * d)))

    def encode(self, update: Mapping[str, np.ndarray], *, rng: np.random.Generator) -> Wire:
        """The k largest-magnitude coordinates of the flattened update."""
        layout = Layout.of(update, averaged=self.averaged)
        # float32 models are selected in float32: exact (same order), half the memory traffic
        single = all(np.dtype(t) == np.float32 for t in layout.dtypes)
        x = layout.flatten(update, dtype=np.float32 if single else np.float64)  # (d,)
        if not np.isfinite(x).all():
            raise ValueError("cannot encode an update with NaN or Inf")
        layout.zero(x, layout.averaged)
        idx = top_k_by_magnitude(x, self.k_for(layout.size))  # (k,)
        return {
            TOPK_INDICES: idx.astype(index_dtype(layout.size)),
            TOPK_VALUES: x[idx].astype(np.float32),
            **pack(update, layout.averaged),
        }

    def decode(self, wire: Mapping[str, np.ndarray], layout: Layout) -> Arrays:
        """Scatter the k values into a dense update of ``layout``; reject malformed input."""
        layout = layout.averaging(self.averaged)
        _check_keys(
            wire, {TOPK_INDICES, TOPK_VALUES, *averaged_keys(layout, layout.averaged)}, self.name
        )
        d, k = layout.size, self.k_for(layout.size)
        idx = _wire_array(wire, TOPK_INDICES, index_dtype(d), (k,))
        values = _wire_array(wire, TOPK_VALUES, np.dtype(np.float32), (k,))
        if k:
            low, high = int(idx.min()), int(idx.max())
            if low < 0:
                raise UpdateRejected(f"{TOPK_INDICES} has a negative index ({low})")
            if high >= d:
                raise UpdateRejected(f"{TOPK_INDICES} has an index out of range [0, {d}): {high}")
            step = np.diff(idx)
            if (step == 0).any():
                raise UpdateRejected(f"{TOPK_INDICES} has a duplicate index")
            if (step < 0).any():
                raise UpdateRejected(f"{TOPK_INDICES} must be sorted ascending")
        if not np.isfinite(values).all():
            raise UpdateRejected(f"{TOPK_VALUES} contains NaN or Inf")
        try:
            out = layout.scatter(idx, values)
        except ValueError as exc:  # a value that does not fit an integer buffer
            raise UpdateRejected(str(exc)) from None
        out.update(averaged_from_wire(wire, layout, layout.averaged))
        return out


# ---------------------------------------------------------------------------- int8
def quantize_int8(
    x: np.ndarray,
    rng: np.random.Generator,
    *,
    chunk: int = QUANT_CHUNK,
    decoded: np.ndarray | None = None,
    residual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.float32]:
    """Stochastic 8-bit quantization of one float array: (q int8 of x's shape, s float32).

    s = max|x| rounded up to float32 (so |x| <= s); with y = 127·x/s in float64,
    q = ⌊y⌋ + 1[U < y − ⌊y⌋], U ~ Uniform[0, 1) from ``rng.random`` (one float64 draw per
    element, in C order), so E[q] = y exactly and |q − y| < 1. A zero array gets s = 0,
    q = 0 and draws nothing.

    Elements are processed ``chunk`` at a time so the float64 temporaries stay in cache;
    the generator yields the same stream however its draws are split, so q does not depend
    on ``chunk``. ``decoded`` and ``residual``: as in ``quantize_int4``, with the values
    q·(s/127) that ``StochasticInt8.decode`` gives.
    """
    shape = np.shape(x)
    flat = np.asarray(x).reshape(-1)  # (n,) view
    n = flat.size
    m = max(-float(flat.min()), float(flat.max())) if n else 0.0  # max|x|, no |x| temporary
    if not math.isfinite(m):
        raise ValueError("cannot quantize an array with NaN or Inf")
    s = np.float32(m)
    if float(s) < m:
        s = np.nextafter(s, np.float32(np.inf))
    if not np.isfinite(s):
        raise ValueError(f"max |x| = {m} does not fit a float32 scale")
    q = np.zeros(n, dtype=np.int8)  # (n,)
    if s == 0:  # (s may be −0.0: decode's q·s/127 is then −0.0, as given here)
        _deliver(q, float(s) / INT8_LEVELS, flat.dtype, 0, decoded, residual)
        return q.reshape(shape), s
    width = min(chunk, n)
    y, low, u = np.empty(width), np.empty(width), np.empty(width)  # float64 (width,)
    up = np.empty(width, dtype=bool)
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        yk, lowk, uk, upk = y[:k], low[:k], u[:k], up[:k]
        # |x| <= s ⇒ |x/s| <= 1 (division rounds monotonically) ⇒ |y| <= 127: q fits int8
        np.divide(flat[start : start + k], float(s), out=yk, dtype=np.float64)
        yk *= INT8_LEVELS
        _round_stochastically(yk, lowk, uk, upk, rng)
        q[start : start + k] = lowk
        _deliver(lowk, float(s) / INT8_LEVELS, flat.dtype, start, decoded, residual)
    return q.reshape(shape), s


def _round_stochastically(
    y: np.ndarray, q: np.ndarray, u: np.ndarray, up: np.ndarray, rng: np.random.Generator
) -> None:
    """q ← ⌊y⌋ + 1[U < y − ⌊y⌋], U from ``rng.random`` (one draw per element, in order),
    in place in the caller's buffers (float64 q and u, bool up); y is left holding its
    fractional part."""
    np.floor(y, out=q)
    y -= q  # fractional part, exact
    rng.random(out=u)
    np.less(u, y, out=up)
    q += up


def _deliver(
    q: np.ndarray,
    step: float | np.ndarray,
    dtype: np.dtype,
    start: int,
    decoded: np.ndarray | None,
    residual: np.ndarray | None,
) -> None:
    """A chunk's decoded values q·step (float64, rounded to ``dtype``: what the server
    decodes) into ``decoded[start:]`` and subtracted from ``residual[start:]``, each when
    given, while the chunk is in cache."""
    if decoded is None and residual is None:
        return
    k = q.size
    values = decoded[start : start + k] if decoded is not None else np.empty(k, dtype)
    np.multiply(q, step, out=values, casting="same_kind")
    if residual is not None:
        residual[start : start + k] -= values


@dataclass(frozen=True)
class StochasticInt8:
    """Per-array stochastic rounding to int8 with a float32 scale (QSGD-style, 255 levels).

    Notes
    -----
    Wire per float array ``n``: ``int8.<n>`` (int8, n's shape, values in [−127, 127]) and
    ``int8.<n>.scale`` ((1,) float32, s >= 0); decode gives q·s/127, so E[decode] = x (up
    to the rounding of the result to the array's dtype) and |decode − x| <= s/127. The
    ``Layout.averaged`` arrays (integer and bool ones, running statistics) pass through
    exactly, concatenated (``averaged/<dtype>``). Arrays are visited in ``Layout`` order,
    each drawing its uniforms from ``rng`` in turn (see ``quantize_int8``).
    """

    averaged: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """Spec of this codec."""
        return "int8"

    def encode(self, update: Mapping[str, np.ndarray], *, rng: np.random.Generator) -> Wire:
        """Quantize every float array but the averaged ones; send those exactly."""
        return _quantized_encode(self, update, rng)

    def decode(self, wire: Mapping[str, np.ndarray], layout: Layout) -> Arrays:
        """Dequantize q·s/127 into each float array's dtype; check the exact ones."""
        layout = layout.averaging(self.averaged)
        _check_keys(wire, self._keys(layout), self.name)
        out: Arrays = averaged_from_wire(wire, layout, layout.averaged)
        for n, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
            if n in out:
                continue
            key = INT8_PREFIX + n
            q = _wire_array(wire, key, np.dtype(np.int8), shape)
            scale = _wire_array(wire, key + SCALE_SUFFIX, np.dtype(np.float32), (1,))
            s = float(scale[0])
            if not (math.isfinite(s) and s >= 0.0):
                raise UpdateRejected(f"{key}{SCALE_SUFFIX} must be finite and >= 0, got {s}")
            if q.size and q.min() < -INT8_LEVELS:
                raise UpdateRejected(f"{key} has code {q.min()} outside [-127, 127]")
            if s == 0.0 and q.any():
                raise UpdateRejected(f"{key} has non-zero codes with scale 0")
            value = np.empty(shape, dtype=dtype)
            # q·s/127 in float64, cast to the array's dtype block by block (no temporaries)
            with np.errstate(over="ignore"):  # a hostile scale: refused just below
                np.multiply(q, s / INT8_LEVELS, out=value, dtype=np.float64, casting="same_kind")
            _require_within_dtype(value, key)
            out[n] = value
        return out

    @staticmethod
    def _keys(layout: Layout) -> set[str]:
        """The wire keys of ``layout``; a float array 'x' beside a float 'x.scale' collide."""
        return _quantized_keys(layout, INT8_PREFIX, "int8")


def _quantized_keys(layout: Layout, prefix: str, codec: str) -> set[str]:
    """A quantizing codec's wire keys for ``layout``: codes and scales of each compressed
    array, then the exact ones; ``ConfigError`` when two of them collide."""
    keys: list[str] = list(averaged_keys(layout, layout.averaged))
    for n in layout.names:
        if n not in layout.averaged:
            keys += [prefix + n, prefix + n + SCALE_SUFFIX]
    unique = set(keys)
    if len(unique) != len(keys):
        clash = sorted(k for k in unique if keys.count(k) > 1)
        raise ConfigError(
            f"{codec} cannot encode this model: wire keys {clash} collide "
            "(an array 'x' beside an array 'x.scale'); use 'topk:<k>' or 'none'"
        )
    return unique


# ---------------------------------------------------------------------------- int4
def quantize_int4(
    x: np.ndarray,
    rng: np.random.Generator,
    *,
    chunk: int = QUANT_CHUNK,
    decoded: np.ndarray | None = None,
    residual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Stochastic 4-bit quantization of one float array, a scale per block of 64 elements.

    Returns (codes, scales): ``codes`` uint8 of ⌈n/2⌉ bytes, element 2i in the low nibble
    of byte i and element 2i + 1 in its high nibble, each the nibble q + 8 (an odd n pads
    the last high nibble with 8, q = 0); ``scales`` float32 of ⌈n/64⌉, s_b = max|x| over
    block b rounded up to float32 (so |x| <= s_b). With y = 7·x/s_b in float64,
    q = ⌊y⌋ + 1[U < y − ⌊y⌋], U ~ Uniform[0, 1) from ``rng.random`` (one float64 draw per
    element, in C order, zero blocks included), so E[q] = y and |q − y| < 1; a zero
    block gets s_b = 0 and q = 0. Elements go ``chunk`` at a time (a multiple of the
    block) through buffers that stay in cache, which changes no result.

    For error feedback, which needs what the server will decode (q·s_b/7 in float64,
    rounded to x's dtype, as ``dequantize_int4`` gives it), while each chunk's q is at
    hand rather than in more passes over the model: ``decoded`` (flat, n elements, x's
    dtype) receives those values, and ``residual`` (flat float64, n elements) has them
    subtracted, each when given (both partly written if this raises).
    """
    if chunk % (2 * INT4_BLOCK):
        raise ValueError(f"chunk must be a multiple of {2 * INT4_BLOCK}, got {chunk}")
    flat = np.asarray(x).reshape(-1)  # (n,) view
    n = flat.size
    scales = np.zeros(-(-n // INT4_BLOCK), dtype=np.float32)  # (⌈n/64⌉,)
    codes = np.empty(-(-n // 2), dtype=np.uint8)  # (⌈n/2⌉,)
    width = min(chunk, scales.size * INT4_BLOCK)
    y = np.empty(width)  # float64: x in whole blocks (zeros after), then y, then y − ⌊y⌋
    q = np.empty(width + 1)  # ⌊y⌋, then q; one more for an odd n's padding level
    u = np.empty(width)  # the uniforms
    up = np.empty(width, dtype=bool)
    pair = np.array([1.0, 16.0])  # two levels a byte: (q_2i + 8) + 16·(q_2i+1 + 8)
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        whole = -(-k // INT4_BLOCK) * INT4_BLOCK
        yk, qk, uk, upk = y[:k], q[:k], u[:k], up[:k]
        yk[...] = flat[start : start + k]
        y[k:whole] = 0.0
        blocks = y[:whole].reshape(-1, INT4_BLOCK)  # (blocks, 64)
        m = np.abs(blocks).max(axis=1)  # (blocks,) max|x| per block
        if not np.isfinite(m).all():
            raise ValueError("cannot quantize an array with NaN or Inf")
        s = m.astype(np.float32)
        low = s.astype(np.float64) < m
        s[low] = np.nextafter(s[low], np.float32(np.inf))
        if not np.isfinite(s).all():
            raise ValueError(f"max |x| = {m.max()} does not fit a float32 scale")
        scales[start // INT4_BLOCK : start // INT4_BLOCK + s.size] = s
        # |x| <= s ⇒ |y| <= 7: q fits [−7, 7]; a zero block divides by 1 (its x are 0)
        np.divide(blocks, np.where(s > 0, s, 1).astype(np.float64)[:, None], out=blocks)
        yk *= INT4_LEVELS
        _round_stochastically(yk, qk, uk, upk, rng)
        if decoded is not None or residual is not None:
            step = np.repeat(s.astype(np.float64) / INT4_LEVELS, INT4_BLOCK)[:k]
            _deliver(qk, step, flat.dtype, start, decoded, residual)
        q[k] = 0.0  # an odd n's last byte: level 0 in its high nibble
        pairs = q[: k + k % 2].reshape(-1, 2)
        packed = codes[start // 2 : start // 2 + pairs.shape[0]]
        np.add(pairs @ pair, INT4_ZERO * 17, out=packed, casting="unsafe")  # exact, 17..255
    return codes, scales


def int4_levels(codes: np.ndarray, n: int) -> np.ndarray:
    """The n levels q ∈ [−8, 7] (int8) that ``quantize_int4``'s bytes hold, in order."""
    nibbles = np.empty(2 * codes.size, dtype=np.int8)
    nibbles[0::2] = codes & 0x0F
    nibbles[1::2] = codes >> 4
    return nibbles[:n] - np.int8(INT4_ZERO)


def dequantize_int4(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> bool:
    """q·s/7 (in float64, then ``out``'s dtype) into the flat ``out``, a chunk of whole
    blocks at a time; False (``out`` partly written) if a block of scale 0 has a code
    other than 8. A value past ``out``'s dtype becomes inf, for the caller to refuse."""
    size = out.size
    for first in range(0, size, QUANT_CHUNK):
        last = min(first + QUANT_CHUNK, size)
        levels = int4_levels(codes[first // 2 : (last + 1) // 2], last - first)
        blocks = scales[first // INT4_BLOCK : -(-last // INT4_BLOCK)]
        zero = blocks == 0
        if zero.any() and levels[np.repeat(zero, INT4_BLOCK)[: last - first]].any():
            return False
        step = np.repeat(blocks.astype(np.float64) / INT4_LEVELS, INT4_BLOCK)
        with np.errstate(over="ignore"):
            np.multiply(levels, step[: last - first], out=out[first:last], casting="same_kind")
    return True


@dataclass(frozen=True)
class StochasticInt4:
    """Block-wise stochastic rounding to 4 bits, two codes a byte, a float32 scale a block.

    Notes
    -----
    Wire per float array ``n`` of N elements: ``int4.<n>`` (uint8, ⌈N/2⌉ bytes of nibbles
    q + 8, q ∈ [−7, 7]) and ``int4.<n>.scale`` (float32, ⌈N/64⌉ scales s >= 0); decode
    gives q·s/7 in the array's shape and dtype, so E[decode] = x (up to that rounding)
    and |decode − x| <= s/7 per block. 4.5 bits an element: 7.1× fewer bytes than
    float32 (int8: 4×). The ``Layout.averaged`` arrays pass through exactly, as with
    int8; arrays are visited in ``Layout`` order, each drawing from ``rng`` in turn.
    """

    averaged: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """Spec of this codec."""
        return "int4"

    def encode(self, update: Mapping[str, np.ndarray], *, rng: np.random.Generator) -> Wire:
        """Quantize every float array but the averaged ones; send those exactly."""
        return _quantized_encode(self, update, rng)

    def decode(self, wire: Mapping[str, np.ndarray], layout: Layout) -> Arrays:
        """Dequantize q·s/7 into each float array's shape and dtype; check everything."""
        layout = layout.averaging(self.averaged)
        _check_keys(wire, _quantized_keys(layout, INT4_PREFIX, self.name), self.name)
        out: Arrays = averaged_from_wire(wire, layout, layout.averaged)
        for n, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
            if n in out:
                continue
            key = INT4_PREFIX + n
            size = math.prod(shape)
            codes = _wire_array(wire, key, np.dtype(np.uint8), (-(-size // 2),))
            scales = _wire_array(
                wire, key + SCALE_SUFFIX, np.dtype(np.float32), (-(-size // INT4_BLOCK),)
            )
            if not (np.isfinite(scales).all() and (scales >= 0).all()):
                raise UpdateRejected(f"{key}{SCALE_SUFFIX} must be finite and >= 0")
            if ((codes & 0x0F) == 0).any() or ((codes >> 4) == 0).any():
                raise UpdateRejected(f"{key} has nibble 0 (level -8), outside [-7, 7]")
            if size % 2 and codes[-1] >> 4 != INT4_ZERO:
                raise UpdateRejected(f"{key} pads its last byte with {codes[-1] >> 4}, not 8")
            value = np.empty(size, dtype=dtype)
            if not dequantize_int4(codes, scales, value):
                raise UpdateRejected(f"{key} has non-zero codes in a block of scale 0")
            _require_within_dtype(value, key)
            out[n] = value.reshape(shape)
        return out


# ---------------------------------------------------------------------------- parsing
def make_codec(spec: str, *, averaged: Sequence[str] = ()) -> Codec:
    """Parse a codec spec: 'none', 'int8', 'int4', 'topk:<k>' or 'topk:<fraction>'; ``averaged``:
    arrays the user named to travel exactly (see ``Codec``).

    The top-k argument is a fraction of d when it contains a '.' or an exponent, or is
    below 1 ('topk:0.01', 'topk:1e-3'), and a count k otherwise ('topk:5000').
    """
    return with_averaged(_parse_codec(spec), averaged)


def with_averaged(codec: Codec, averaged: Sequence[str]) -> Codec:
    """``codec`` sending the ``averaged`` arrays exactly (and the rule's, as always)."""
    if tuple(averaged) == codec.averaged:
        return codec
    return replace(codec, averaged=tuple(averaged))  # type: ignore[type-var]


def _parse_codec(spec: str) -> Codec:
    text = spec.strip().lower() if isinstance(spec, str) else ""
    if text == "none":
        return Identity()
    if text == "int8":
        return StochasticInt8()
    if text == "int4":
        return StochasticInt4()
    head, sep, arg = text.partition(":")
    if head == "topk" and sep:
        arg = arg.strip()
        try:
            if any(c in arg for c in ".e"):
                fraction = float(arg)
                if not math.isfinite(fraction):
                    raise ValueError
                return TopK(fraction=fraction)
            number = int(arg)
        except ValueError:
            raise ConfigError(
                f"codec '{spec}': top-k needs a count or a fraction after 'topk:'; "
                f"allowed: {CODEC_SPECS}"
            ) from None
        return TopK(k=number)  # k < 1 is rejected there, with the rule for k
    raise ConfigError(f"unknown codec {spec!r}; allowed: {CODEC_SPECS}")


# ---------------------------------------------------------------------------- error feedback
@dataclass
class ErrorFeedback:
    """The site's residual e: what its codec has not yet delivered.

    ``compress`` sends v = u + e and keeps e ← v − decode(encode(v)), so the server's
    updates plus the residual always sum to the site's true updates. e is float64 (it
    accumulates small float32 roundings too); with ``Identity`` it stays exactly 0.

    Parameters
    ----------
    residual : dict of str to np.ndarray
        float64 arrays shaped like the update; empty means e = 0.
    """

    residual: Arrays = field(default_factory=dict)

    def compress(
        self,
        update: Mapping[str, np.ndarray],
        codec: Codec,
        *,
        rng: np.random.Generator,
        dense: bool = True,
    ) -> tuple[Wire, Arrays | None]:
        """Encode u + e; return (wire, sent_dense) and keep the new residual.

        ``sent_dense`` is exactly what the server decodes (same codec, same layout: the
        update's), in the update's dtypes; None when ``dense`` is False (the caller only
        needs the wire). If encoding fails the residual is unchanged.

        Cost: top-k, int8 and int4 run on the flat float64 vector v = u + e directly, the same
        choices and values as ``codec.encode(layout.unflatten(v))`` and ``codec.decode``
        (tests/strategies/test_codecs.py checks them against that): v, a float32 copy to
        select from and the residual's new values are the only passes over the model.
        """
        layout = Layout.of(update, averaged=codec.averaged)
        if self.residual:
            self._check_layout(layout)
        v = self._plus_residual(update, layout)  # (d,) float64: u + e, a new vector
        fast = _fast_encoder(codec, layout, v)
        if fast is None:
            wire = codec.encode(layout.unflatten(v), rng=rng)
            sent = codec.decode(wire, layout)
            v -= layout.flatten(sent)  # e ← (u + e) − ŝ
        else:
            wire, sent = fast(v, layout, rng, dense)  # v becomes e
        self.residual = layout._split(v)  # views of v, which no one else holds
        return wire, sent

    def _plus_residual(self, update: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
        """u + e as a new (d,) float64 vector; the residual's arrays are only read."""
        v = np.empty(layout.size)  # (d,)
        for name, shape, start, n in zip(
            layout.names, layout.shapes, layout.offsets, layout.sizes, strict=True
        ):
            value = np.asarray(update[name])
            if value.shape != shape:
                raise ValueError(f"array '{name}' has shape {value.shape}, layout says {shape}")
            out = v[start : start + n]
            if self.residual:
                residual = np.asarray(self.residual[name]).reshape(-1)
                np.add(value.reshape(-1), residual, out=out, dtype=np.float64)
            else:
                out[...] = value.reshape(-1)
        return v

    def norm(self) -> float:
        """‖e‖₂, a cheap health metric (it should stay bounded)."""
        return math.sqrt(sum(float(np.vdot(a, a)) for a in self.residual.values()))

    def reset(self) -> None:
        """Forget the residual (e = 0), e.g. when the model's layout changes."""
        self.residual = {}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Plain float64 arrays ``residual.<name>``, for the site's persistent state."""
        return {RESIDUAL_PREFIX + n: a.copy() for n, a in self.residual.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore from ``state_dict()``; every problem is listed in one ``ConfigError``."""
        problems = []
        residual: Arrays = {}
        for key, value in state.items():
            if not key.startswith(RESIDUAL_PREFIX):
                problems.append(f"unexpected key '{key}'")
            elif not isinstance(value, np.ndarray) or value.dtype.kind != "f":
                problems.append(f"'{key}' must be a float array")
            elif not np.isfinite(value).all():
                problems.append(f"'{key}' contains NaN or Inf")
            else:
                residual[key[len(RESIDUAL_PREFIX) :]] = np.array(value, dtype=np.float64)
        if problems:
            raise ConfigError("bad error-feedback state: " + "; ".join(problems))
        self.residual = residual

    def _check_layout(self, layout: Layout) -> None:
        mine = {n: a.shape for n, a in self.residual.items()}
        theirs = dict(zip(layout.names, layout.shapes, strict=True))
        if mine != theirs:
            raise ValueError(
                "the update's arrays differ from the residual's; call reset() after "
                "changing the model"
            )


# ------------------------------------------------------------- error feedback, flat
FLOAT32_EXACT = 2**24  # integers up to this magnitude are exact in float32
_FastEncoder = Any  # (v, layout, rng, dense) -> (wire, sent or None); v becomes e


def _fast_encoder(codec: Codec, layout: Layout, v: np.ndarray) -> _FastEncoder | None:
    """The flat path for ``codec`` and ``layout``, or None for the generic one."""
    if isinstance(codec, TopK) and _selectable_in_float32(layout, v):
        return functools.partial(_topk_feedback, codec)
    if isinstance(codec, StochasticInt8 | StochasticInt4):
        return functools.partial(_quantized_feedback, codec)
    return None


def _selectable_in_float32(layout: Layout, v: np.ndarray) -> bool:
    """Whether the values top-k selects among (v in each array's dtype) are float32s.

    True for float32 arrays and integer arrays within ±2^24: selecting in float32 then
    picks exactly what selecting in float64 would. Other floats take the generic path.
    """
    for name, start, n in zip(layout.names, layout.offsets, layout.sizes, strict=True):
        dtype = layout.dtype_of(name)
        if dtype == np.float32 or n == 0:
            continue
        if dtype.kind == "f":
            return False
        piece = v[start : start + n]
        if not np.isfinite(piece).all() or np.abs(np.rint(piece)).max() > FLOAT32_EXACT:
            return False
    return True


def _spans(layout: Layout) -> list[tuple[str, int, int]]:
    """(name, first flat coordinate, size) of each array, in layout order."""
    return list(zip(layout.names, layout.offsets, layout.sizes, strict=True))


def _in_dtypes_float32(v: np.ndarray, layout: Layout) -> np.ndarray:
    """v as ``layout.unflatten`` gives it (float32 arrays rounded, integers rounded and
    range-checked), flat in float32: exact, by ``_selectable_in_float32``."""
    x = np.empty(layout.size, dtype=np.float32)  # (d,)
    for name, start, n in zip(layout.names, layout.offsets, layout.sizes, strict=True):
        piece = v[start : start + n]
        if layout.is_float(name):
            x[start : start + n] = piece
        else:
            x[start : start + n] = layout._cast(name, piece)
    return x


def _topk_feedback(
    codec: TopK, v: np.ndarray, layout: Layout, rng: np.random.Generator, dense: bool
) -> tuple[Wire, Arrays | None]:
    """``TopK.encode`` of v in its dtypes and e ← v − decode, on the flat vector."""
    x = _in_dtypes_float32(v, layout)  # (d,)
    if not np.isfinite(x).all():
        raise ValueError("cannot encode an update with NaN or Inf")
    layout.zero(x, layout.averaged)
    idx = top_k_by_magnitude(x, codec.k_for(layout.size))  # (k,) ascending
    values = x[idx]  # (k,) float32: what the server scatters, in each array's dtype
    del x
    exact = _send_averaged_exactly(v, layout)  # their residual: v − ŝ is 0
    v[idx] -= values  # e: v − ŝ, ŝ zero off the k coordinates
    wire = {TOPK_INDICES: idx.astype(index_dtype(layout.size)), TOPK_VALUES: values}
    wire.update(pack(exact, layout.averaged))
    if not dense:
        return wire, None
    sent = layout.scatter(idx, values)
    sent.update({name: value.reshape(sent[name].shape) for name, value in exact.items()})
    return wire, sent


def _int8_wire(
    x: np.ndarray,
    rng: np.random.Generator,
    *,
    decoded: np.ndarray | None = None,
    residual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_int8`` as the wire holds it: codes in x's shape, the scale a (1,) array."""
    q, s = quantize_int8(x, rng, decoded=decoded, residual=residual)
    return q, np.array([s], dtype=np.float32)


# each quantizing codec's wire prefix and its quantizer: (codes, scales), and the decoded
# values into ``decoded=`` and out of ``residual=`` when given
_QUANTIZERS: dict[str, tuple[str, Any]] = {
    "int8": (INT8_PREFIX, _int8_wire),
    "int4": (INT4_PREFIX, quantize_int4),
}


def _quantized_encode(
    codec: StochasticInt8 | StochasticInt4,
    update: Mapping[str, np.ndarray],
    rng: np.random.Generator,
) -> Wire:
    """``codec.encode``: every float array but the averaged ones quantized, in ``Layout``
    order, each drawing from ``rng`` in turn; the averaged ones sent exactly."""
    prefix, quantize = _QUANTIZERS[codec.name]
    layout = Layout.of(update, averaged=codec.averaged)
    _quantized_keys(layout, prefix, codec.name)  # refuse layouts whose wire keys collide
    _require_finite({n: update[n] for n in layout.averaged})
    wire: Wire = {}
    for n in layout.names:
        if n not in layout.averaged:
            wire[prefix + n], wire[prefix + n + SCALE_SUFFIX] = quantize(update[n], rng)
    wire.update(pack(update, layout.averaged))
    return wire


def _quantized_feedback(
    codec: StochasticInt8 | StochasticInt4,
    v: np.ndarray,
    layout: Layout,
    rng: np.random.Generator,
    dense: bool,
) -> tuple[Wire, Arrays | None]:
    """``codec.encode`` of v in its dtypes and e ← v − decode, array by array."""
    prefix, quantize = _QUANTIZERS[codec.name]
    # as encode(unflatten(v)): every array cast (integers range-checked) before the keys
    values = [layout._cast(name, v[start : start + n]) for name, start, n in _spans(layout)]
    _quantized_keys(layout, prefix, codec.name)  # refuse layouts whose wire keys collide
    wire: Wire = {}
    sent: Arrays = {}
    for (name, start, n), shape, value in zip(_spans(layout), layout.shapes, values, strict=True):
        piece = v[start : start + n]
        decoded: np.ndarray | None = None
        if name in layout.averaged:
            if not np.isfinite(value).all():
                raise ValueError(f"cannot encode array '{name}': it contains NaN or Inf")
            decoded = value
            piece -= decoded
        else:  # e ← v − what the server will decode, as the codes are made
            decoded = np.empty(n, dtype=value.dtype) if dense else None
            codes, scales = quantize(value.reshape(shape), rng, decoded=decoded, residual=piece)
            wire[prefix + name], wire[prefix + name + SCALE_SUFFIX] = codes, scales
        if dense and decoded is not None:
            sent[name] = decoded.reshape(shape)
    wire.update(
        pack({name: values[layout._position[name]] for name in layout.averaged}, layout.averaged)
    )
    return wire, sent if dense else None


# ------------------------------------------------------------- arrays sent exactly
def _send_averaged_exactly(v: np.ndarray, layout: Layout) -> Arrays:
    """The ``Layout.averaged`` arrays of flat v in their dtypes (flat), what the server
    gets; v's coordinates become what rounding to those dtypes left (the residual)."""
    exact: Arrays = {}
    for name in layout.averaged:
        start, stop = layout.span(name)
        exact[name] = layout._cast(name, v[start:stop])
        v[start:stop] -= exact[name]
    return exact


def averaged_keys(layout: Layout, names: Sequence[str]) -> dict[str, int]:
    """The wire keys ``names`` (averaged arrays of ``layout``) travel under → each
    vector's length (``strategies.averaged_arrays.pack``)."""
    return packed_keys(
        {n: layout.dtype_of(n) for n in names},
        {n: layout.sizes[layout._position[n]] for n in names},
        names,
    )


def averaged_from_wire(
    wire: Mapping[str, np.ndarray], layout: Layout, names: Sequence[str]
) -> Arrays:
    """The arrays ``names`` of a wire as ``pack`` made them (the wire's keys already
    checked), each in its dtype and shape; ``UpdateRejected`` for a vector of the wrong
    dtype or length, a non-finite value, or one its array's dtype cannot hold."""
    if not names:
        return {}
    packed = {}
    for key, length in averaged_keys(layout, names).items():
        value = _wire_array(wire, key, np.dtype(key.removeprefix(AVERAGED)), (length,))
        if not np.isfinite(value).all():
            raise UpdateRejected(f"wire '{key}' contains NaN or Inf")
        packed[key] = value
    dtypes = {n: layout.dtype_of(n) for n in names}
    sizes = {n: layout.sizes[layout._position[n]] for n in names}
    out: Arrays = {}
    for name, piece in unpack(packed, dtypes, sizes, names).items():
        try:
            with np.errstate(over="ignore"):  # an overflow is found just below
                value = layout._cast(name, piece)
        except ValueError as exc:
            raise UpdateRejected(str(exc)) from None
        if value.dtype.kind == "f" and not np.isfinite(value).all():  # float64 → float16
            raise UpdateRejected(f"array '{name}' overflows its dtype {value.dtype}")
        out[name] = value.reshape(layout.shapes[layout._position[name]])
    return out


# ---------------------------------------------------------------------------- wire checks
def _check_keys(wire: Mapping[str, np.ndarray], expected: set[str], codec: str) -> None:
    got = set(wire)
    missing = sorted(expected - got)
    if missing:
        raise UpdateRejected(f"{codec} wire is missing arrays: {', '.join(missing[:5])}")
    extra = sorted(str(k) for k in got - expected)
    if extra:
        raise UpdateRejected(f"{codec} wire has unexpected arrays: {', '.join(extra[:5])}")


def _wire_array(
    wire: Mapping[str, np.ndarray], key: str, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray:
    """``wire[key]`` if it is an array of exactly ``dtype`` and ``shape``, else reject."""
    value = wire[key]
    # exactly ndarray: a subclass (a masked array, say) could hide values from the checks
    if type(value) is not np.ndarray:
        raise UpdateRejected(f"wire '{key}' must be an array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise UpdateRejected(f"wire '{key}' has dtype {value.dtype}, expected {dtype}")
    if value.shape != shape:
        # the usual hostile case: more values than k, or a differently sized model
        raise UpdateRejected(f"wire '{key}' has shape {value.shape}, expected {shape}")
    return value


def _raw_array(wire: Mapping[str, np.ndarray], name: str, layout: Layout) -> np.ndarray:
    j = layout._position[name]
    key = RAW_PREFIX + name
    value = _wire_array(wire, key, layout.dtype_of(name), layout.shapes[j])
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise UpdateRejected(f"wire '{key}' contains NaN or Inf")
    return value


def _require_within_dtype(value: np.ndarray, key: str) -> None:
    """A decoded float array must be finite: a scale past what its dtype holds (a float16
    model's 65504) would make it inf."""
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise UpdateRejected(f"{key} decodes beyond the range of {value.dtype}")


def _require_finite(update: Mapping[str, np.ndarray]) -> None:
    for name, value in update.items():
        a = np.asarray(value)
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"cannot encode array '{name}': it contains NaN or Inf")
