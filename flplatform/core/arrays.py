"""Conversions between Flower's ``ArrayRecord`` and ``{name: ndarray}`` dicts.

Imports nothing of ours beyond Flower's records, so the site side (ClientApp mods) can use
it without loading the server engine. Both directions keep the record's key order: a
user's model is loaded by position as often as by name.
"""

from __future__ import annotations

import functools
import io
import weakref
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy

from flplatform.core.flower_internals import NUMPY_STYPE

# .npy header versions whose header numpy reads with a public function
_NPY_HEADER_READERS = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord → {name: ndarray} (order kept)."""
    return {key: array.numpy() for key, array in record.items()}


def record_views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord → {name: read-only ndarray} reading the record's bytes in place.

    What ``record_to_arrays`` gives, without copying any data: for reading a reply once
    (the server decodes every reply of every round). The arrays keep the record's bytes
    alive and cannot be written to.
    """
    return {key: array_view(array) for key, array in record.items()}


# id(view) -> (a weak reference to the view, the Array it reads, that Array's bytes):
# encoding a view of an Array again gives that Array back (``encode``), with no copy. A
# view cannot be written to and ``bytes`` never change, so while the Array still holds
# the same bytes object the two hold the same values.
_SOURCES: dict[int, tuple[weakref.ref[np.ndarray], Array, bytes]] = {}


def _remember_source(view: np.ndarray, array: Array, header: bytes) -> np.ndarray:
    """Register ``view`` as ``array``'s when the Array is exactly what ``encode`` would
    write for it (a .npy 1.0 header, no bytes beyond the data, metadata that agrees):
    only then may ``encode`` hand the Array on instead of new bytes."""
    canonical = (
        array.data[_PREFIX : _PREFIX + 1] == b"\x01"
        and len(array.data) == len(header) + view.nbytes
        and array.dtype == str(view.dtype)
        and tuple(array.shape) == view.shape
        and header == _npy_header(view.dtype, view.shape)
    )
    if canonical:
        key = id(view)

        def forget(_: weakref.ref[np.ndarray]) -> None:
            _SOURCES.pop(key, None)

        _SOURCES[key] = (weakref.ref(view, forget), array, array.data)
    return view


def array_view(array: Array) -> np.ndarray:
    """``array.numpy()`` as a read-only view of ``array.data`` (``np.frombuffer`` after the
    .npy header); anything but a plain .npy of fixed-size items (an object array, a
    truncated buffer, an unusual header) takes Flower's own path, with its errors."""
    data = array.data
    if array.stype == NUMPY_STYPE and data[:_PREFIX] == npy.MAGIC_PREFIX:
        length_bytes = _HEADER_LENGTH_BYTES.get(data[_PREFIX : _PREFIX + 1])  # major version
        if length_bytes is not None:
            start = _PREFIX + 2 + length_bytes
            header = bytes(data[: start + int.from_bytes(data[_PREFIX + 2 : start], "little")])
            try:
                layout = _npy_layout(header)
                if layout is not None:
                    shape, fortran_order, dtype = layout
                    count = int(np.prod(shape, dtype=np.int64))
                    if count * dtype.itemsize > len(data) - len(header):
                        raise ValueError("the .npy data is shorter than its header says")
                    flat = np.frombuffer(data, dtype=dtype, count=count, offset=len(header))
                    if fortran_order:  # as numpy.lib.format.read_array lays it out
                        return flat.reshape(shape[::-1]).transpose()
                    return _remember_source(flat.reshape(shape), array, header)
            except ValueError:
                pass  # Flower's path raises the error a caller expects
    return array.numpy()


_PREFIX = len(npy.MAGIC_PREFIX)
_HEADER_LENGTH_BYTES = {b"\x01": 2, b"\x02": 4}  # .npy 1.x, 2.x: uint16 or uint32 length


@functools.lru_cache(maxsize=1024)
def _npy_layout(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """(shape, Fortran order, dtype) of a whole .npy header, None for arrays a view cannot
    hold (objects, zero-size items); raises ValueError for a bad header. Cached: every
    reply of a round repeats the same few headers, and numpy parses one with
    ``ast.literal_eval`` (some 50 µs)."""
    stream = io.BytesIO(header)
    read_header = _NPY_HEADER_READERS.get(npy.read_magic(stream))
    if read_header is None:
        return None
    shape, fortran_order, dtype = read_header(stream)
    if stream.tell() != len(header) or dtype.hasobject or dtype.itemsize == 0:
        return None
    if any(not isinstance(n, int) or n < 0 for n in shape):
        return None  # numpy refuses a negative dimension: Flower's path says so
    return shape, fortran_order, dtype


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """{name: ndarray} → ArrayRecord (order kept), each array encoded by ``encode``."""
    record = ArrayRecord()  # set one by one: ArrayRecord(dict) rebuilds every Array
    for key, value in arrays.items():
        record[key] = encode(value)
    return record


def encode(value: np.ndarray) -> Array:
    """Flower's ``Array(value)``: the same .npy bytes, written with one copy of the data.

    Flower's constructor runs ``np.save`` into a ``BytesIO`` (the data copied three times,
    about 50 ms for 40 MB); here the header is numpy's own (``write_array_header_1_0``,
    what ``np.save`` writes for every array whose header fits version 1.0) and the data is
    joined to it once. A read-only view of an Array (``array_view``) whose bytes are
    exactly these gives that Array back, uncopied. Anything else (object arrays, a header
    needing .npy 2.0) takes Flower's path.
    """
    source = _SOURCES.get(id(value))
    if source is not None and source[0]() is value and source[1].data is source[2]:
        return source[1]
    # asarray, not ascontiguousarray: that makes a 0-d array (a BatchNorm counter) 1-d.
    array = np.asarray(value, order="C")
    header = _npy_header(array.dtype, array.shape) if not array.dtype.hasobject else None
    if header is None or array.dtype.itemsize == 0:
        return Array(array)
    data = b"".join((header, array.reshape(-1).view(np.uint8).data))
    return Array(dtype=str(array.dtype), shape=tuple(array.shape), stype=NUMPY_STYPE, data=data)


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """The .npy 1.0 header ``np.save`` writes for a C-ordered array; None if it needs 2.0."""
    stream = io.BytesIO()
    layout = {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        npy.write_array_header_1_0(stream, layout)
    except ValueError:  # too long for a 1.0 header
        return None
    return stream.getvalue()
