"""Conversions between Flower's ``ArrayRecord`` and ``{name: ndarray}`` dicts.

Imports nothing of ours beyond Flower's records, so the site side (ClientApp mods) can use
it without loading the server engine. Both directions keep the record's key order: a
user's model is loaded by position as often as by name.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord → {name: ndarray} (order kept)."""
    return {key: array.numpy() for key, array in record.items()}


def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """{name: ndarray} → ArrayRecord (order kept)."""
    # asarray, not ascontiguousarray: that makes a 0-d array (a BatchNorm counter) 1-d.
    return ArrayRecord({key: Array(np.asarray(value, order="C")) for key, value in arrays.items()})
