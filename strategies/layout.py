"""A model's arrays as one flat vector: names, shapes, dtypes and where each array lies.

Sites and servers that compress or sketch an update flatten it the same way: arrays in
sorted-name order, whatever order their dicts were built in. ``Layout`` flattens and
splits, scatters sparse values back into arrays, casts each piece to its array's dtype
(integers rounded and range-checked) and names the arrays sent exactly
(``Layout.averaged``). ``difference`` is a site's update in the model's dtypes. Pure
NumPy; no Flower imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from strategies.averaged_arrays import averaged_arrays

Arrays = dict[str, np.ndarray]

# dtype kinds a layout accepts: float, signed/unsigned integer, bool (model buffers)
_REAL_KINDS = "fiub"


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of a model's arrays, and their order in a flat vector.

    Parameters
    ----------
    names : tuple of str
        Array names, sorted: a site and the server then agree on what coordinate i is,
        whatever order their dicts were built in.
    shapes : tuple of tuple of int
        Shape of each array.
    dtypes : tuple of np.dtype
        Dtype of each array (float, integer or bool).
    named_averaged : tuple of str
        Arrays the user named to be averaged whole, beside those
        ``strategies.averaged_arrays``' rule finds (see ``averaged``).

    Notes
    -----
    Array ``names[j]`` occupies coordinates ``[offsets[j], offsets[j] + sizes[j])`` of the
    flat vector of length d = ``size``.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype[Any], ...]
    named_averaged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError("layout needs one shape and one dtype per name")
        if list(self.names) != sorted(set(self.names)):
            raise ValueError("layout names must be unique and sorted")
        for name, dtype in zip(self.names, self.dtypes, strict=True):
            if np.dtype(dtype).kind not in _REAL_KINDS:
                raise ValueError(f"array '{name}' has dtype {dtype}; codecs handle real numbers")

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], *, averaged: Sequence[str] = ()) -> Layout:
        """The layout of ``arrays`` (names sorted); ``averaged``: ``named_averaged``."""
        names = tuple(sorted(arrays))
        return cls(
            names=names,
            shapes=tuple(tuple(np.shape(arrays[n])) for n in names),
            dtypes=tuple(np.asarray(arrays[n]).dtype for n in names),
            named_averaged=tuple(averaged),
        )

    def averaging(self, named: Sequence[str]) -> Layout:
        """This layout with ``named_averaged`` = ``named`` (itself when they are the same)."""
        if tuple(named) == self.named_averaged:
            return self
        return replace(self, named_averaged=tuple(named))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each array."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """First flat coordinate of each array."""
        starts = np.cumsum((0, *self.sizes))[:-1]
        return tuple(int(s) for s in starts)

    @property
    def size(self) -> int:
        """Total number of coordinates d."""
        return sum(self.sizes)

    @cached_property
    def _position(self) -> dict[str, int]:
        return {name: j for j, name in enumerate(self.names)}

    @cached_property
    def averaged(self) -> tuple[str, ...]:
        """Arrays a codec sends exactly, not compressed (``strategies.averaged_arrays``)."""
        named = self.named_averaged
        return averaged_arrays({name: self.dtype_of(name) for name in self.names}, named)

    def span(self, name: str) -> tuple[int, int]:
        """Flat coordinates ``[start, stop)`` of array ``name``."""
        j = self._position[name]
        return self.offsets[j], self.offsets[j] + self.sizes[j]

    def zero(self, vector: np.ndarray, names: Sequence[str]) -> None:
        """Zero the coordinates of arrays ``names`` in a flat (d,) ``vector``, in place."""
        for name in names:
            start, stop = self.span(name)
            vector[start:stop] = 0

    def dtype_of(self, name: str) -> np.dtype[Any]:
        """Dtype of array ``name``."""
        return np.dtype(self.dtypes[self._position[name]])

    def is_float(self, name: str) -> bool:
        """Whether array ``name`` holds floats (weights) rather than integers or bools."""
        return self.dtype_of(name).kind == "f"

    def flatten(
        self, arrays: Mapping[str, np.ndarray], dtype: npt.DTypeLike = np.float64
    ) -> np.ndarray:
        """Concatenate ``arrays`` in layout order into a new (d,) vector (float64 by default).

        The arrays must have this layout's names and shapes (any real dtype).
        """
        self._check_names(arrays)
        out = np.empty(self.size, dtype=dtype)  # (d,)
        for name, shape, start, n in zip(
            self.names, self.shapes, self.offsets, self.sizes, strict=True
        ):
            value = np.asarray(arrays[name])
            if value.shape != shape:
                raise ValueError(f"array '{name}' has shape {value.shape}, layout says {shape}")
            out[start : start + n] = value.reshape(-1)
        return out

    def unflatten(self, vector: np.ndarray) -> Arrays:
        """Split a (d,) vector into new arrays of this layout's shapes and dtypes.

        Integer and bool arrays are rounded to the nearest integer first; a value outside
        an integer dtype's range raises ``ValueError`` (a cast would silently wrap).
        """
        return {name: self._cast(name, piece) for name, piece in self._split(vector).items()}

    def scatter(self, indices: np.ndarray, values: np.ndarray) -> Arrays:
        """New arrays of this layout, zero except ``values`` at the flat ``indices``.

        The same as ``unflatten`` of a dense vector holding ``values`` at ``indices``, without
        building that float64 vector: each array is filled in its own dtype. ``indices``
        must be ascending and in [0, d).
        """
        # bounds[j]:bounds[j + 1] is the run of indices that fall in array j
        bounds = np.searchsorted(indices, (*self.offsets, self.size))
        out: Arrays = {}
        for j, name in enumerate(self.names):
            a, b = int(bounds[j]), int(bounds[j + 1])
            piece = np.zeros(self.sizes[j], dtype=self.dtype_of(name))  # (n_j,)
            piece[indices[a:b] - self.offsets[j]] = self._cast(name, values[a:b])
            out[name] = piece.reshape(self.shapes[j])
        return out

    def assign(
        self, arrays: Mapping[str, np.ndarray], indices: np.ndarray, values: np.ndarray
    ) -> Arrays:
        """New copies of ``arrays`` (this layout's) with ``values`` at the flat ``indices``.

        Each value is cast to its array's dtype as ``scatter`` casts it (integers rounded
        and range-checked); a repeated index keeps its last value. The same as
        ``unflatten`` of ``flatten(arrays)`` with the values set, without float64 copies.
        """
        if indices.size > 1 and (indices[1:] < indices[:-1]).any():  # np.diff wraps unsigned
            order = np.argsort(indices, kind="stable")  # repeats keep their order
            indices, values = indices[order], values[order]
        bounds = np.searchsorted(indices, (*self.offsets, self.size))
        out: Arrays = {}
        for j, name in enumerate(self.names):
            a, b = int(bounds[j]), int(bounds[j + 1])
            piece = np.array(arrays[name], dtype=self.dtype_of(name)).reshape(-1)  # a copy
            if b > a:
                piece[indices[a:b] - self.offsets[j]] = self._cast(name, values[a:b])
            out[name] = piece.reshape(self.shapes[j])
        return out

    def flat_difference(
        self, trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """(trained − start) flattened in layout order, float32: a sketch's input.

        What float32 of the float64 difference gives, to the bit: float32 and float16
        arrays subtract in float32 (one rounding of the exact difference), others in
        float64 first (see ``difference``).
        """
        self._check_names(trained)
        out = np.empty(self.size, dtype=np.float32)  # (d,)
        for name, shape, begin, n in zip(
            self.names, self.shapes, self.offsets, self.sizes, strict=True
        ):
            after, before = np.asarray(trained[name]), np.asarray(start[name])
            if after.shape != shape or before.shape != shape:
                raise ValueError(f"array '{name}' does not have the layout's shape {shape}")
            piece = out[begin : begin + n]
            if (
                after.dtype.kind == before.dtype.kind == "f"
                and max(after.dtype.itemsize, before.dtype.itemsize) <= 4
            ):
                # A float difference may overflow to inf (or meet one): the caller's
                # finiteness check says what went wrong, not a NumPy warning.
                with np.errstate(invalid="ignore", over="ignore"):
                    np.subtract(after.reshape(-1), before.reshape(-1), out=piece, dtype=np.float32)
            else:
                piece[...] = (after.astype(np.float64) - before).reshape(-1)
        return out

    def _cast(self, name: str, piece: np.ndarray) -> np.ndarray:
        """A new array of ``piece``'s values in array ``name``'s dtype (integers rounded)."""
        dtype = self.dtype_of(name)
        if dtype.kind == "f":
            return piece.astype(dtype)
        piece = np.asarray(np.rint(piece))  # asarray: rint of a 0-d array is a scalar
        if dtype.kind in "iu" and piece.size:
            info = np.iinfo(dtype)
            # both bounds are powers of two (or 0), so exact in float64
            low, high = float(info.min), float(int(info.max) + 1)
            if not (low <= piece.min() and piece.max() < high):
                raise ValueError(f"array '{name}' has values outside the range of {dtype}")
        return piece.astype(dtype)

    def _split(self, vector: np.ndarray) -> Arrays:
        """Views of a (d,) vector shaped like each array, in the vector's dtype."""
        vector = np.asarray(vector)
        if vector.shape != (self.size,):
            raise ValueError(f"vector must have shape ({self.size},), got {vector.shape}")
        return {
            name: vector[start : start + n].reshape(shape)
            for name, shape, start, n in zip(
                self.names, self.shapes, self.offsets, self.sizes, strict=True
            )
        }

    def _check_names(self, arrays: Mapping[str, np.ndarray]) -> None:
        if set(arrays) != set(self.names):
            missing = sorted(set(self.names) - set(arrays))
            extra = sorted(set(arrays) - set(self.names))
            raise ValueError(f"arrays do not match the layout: missing {missing}, extra {extra}")


def difference(trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> Arrays:
    """trained − start in each array's dtype, in ``start``'s order: a site's update.

    The float64 difference rounded to the array's dtype, computed without float64
    copies: for float arrays one subtraction in their own dtype rounds the exact
    difference once, and rounding it to float64 first changes nothing (double rounding
    is innocuous when the wider format has at least 2p + 2 bits: 53 >= 2·24 + 2).
    Integer and bool arrays go through float64. A bool or unsigned array cannot hold a
    decrease, which travels as no change (``carried``) rather than wrapped around.
    """
    out: Arrays = {}
    for name, given in start.items():
        value = np.asarray(trained[name])
        if given.dtype.kind == "f" and value.dtype == given.dtype:
            with np.errstate(invalid="ignore", over="ignore"):  # non-finite: the caller judges
                out[name] = np.subtract(value, given, out=np.empty(given.shape, given.dtype))
        else:
            out[name] = carried(value.astype(np.float64) - given, given.dtype)
    return out


def carried(delta: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float64 change as an array of ``dtype`` (integers truncated, as ``astype`` does).

    A bool or unsigned array's decrease (a mask bit turned off, a counter that went down)
    is sent as no change: in their dtype it wrapped round (a uint8 counter 5 → 3 sent 254,
    and the server refused the step or set 133; a bit turned off sent True, turning it
    on). Deltas travel in the model's dtypes (``strategies.mods``), so such arrays can only
    grow: the mods' documentation says to keep them constant during training.
    """
    if dtype.kind in "ub":
        delta = np.maximum(delta, 0.0)
    return np.asarray(delta.astype(dtype))
