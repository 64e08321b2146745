"""Data files as the ``clients`` tests write and compare them: IDX files, rows as multisets."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def sorted_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Rows ``(label, pixels...)`` sorted lexicographically: equal iff equal as multisets."""
    rows = np.concatenate([y.reshape(-1, 1).astype(np.float64), x.reshape(len(x), -1)], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def write_idx(path: Path, array: np.ndarray, *, type_code: int = 0x08) -> None:
    """Write ``array`` (uint8) as a gzipped IDX file, the MNIST family's format."""
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as stream:
        stream.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())
