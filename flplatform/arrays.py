"""Conversions between Flower's ``ArrayRecord`` and ``{name: ndarray}`` dicts.

Imports nothing of ours beyond Flower's records, so the site side (ClientApp mods) can use
it without loading the server engine. Both directions keep the record's key order: a
user's model is loaded by position as often as by name.
"""

from __future__ import annotations

import io

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType
from numpy.lib import format as npy

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


def array_view(array: Array) -> np.ndarray:
    """``array.numpy()`` as a read-only view of ``array.data`` (``np.frombuffer`` after the
    .npy header); anything but a plain .npy of fixed-size items (an object array, a
    truncated buffer, an unusual header) takes Flower's own path, with its errors."""
    data = array.data
    if array.stype == SType.NUMPY and data[: len(npy.MAGIC_PREFIX)] == npy.MAGIC_PREFIX:
        try:
            stream = io.BytesIO(data)  # shares ``data``; only the header is read from it
            read_header = _NPY_HEADER_READERS.get(npy.read_magic(stream))
            if read_header is not None:
                shape, fortran_order, dtype = read_header(stream)
                if not dtype.hasobject and dtype.itemsize > 0:
                    count = int(np.prod(shape, dtype=np.int64))
                    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
                    if fortran_order:  # as numpy.lib.format.read_array lays it out
                        return flat.reshape(shape[::-1]).transpose()
                    return flat.reshape(shape)
        except ValueError:
            pass  # Flower's path raises the error a caller expects, or reads what this cannot
    return array.numpy()


def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """{name: ndarray} → ArrayRecord (order kept)."""
    # asarray, not ascontiguousarray: that makes a 0-d array (a BatchNorm counter) 1-d.
    return ArrayRecord({key: Array(np.asarray(value, order="C")) for key, value in arrays.items()})
