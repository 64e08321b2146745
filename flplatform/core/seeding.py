"""Randomness as a function of (seed, round, site).

Every random choice (site sampling, data order, partitions, simulated delays, sketch
hashes, stochastic rounding) draws from a generator derived from the run's seed and the
coordinates of the choice, never from global state. The same seed gives the same run, and
a resumed run continues the same sequence.
"""

from __future__ import annotations

import hashlib

import numpy as np


def derive_seed(seed: int, *parts: int | str) -> int:
    """Return a 63-bit seed derived from ``seed`` and the coordinates ``parts``.

    Strings are hashed (stable across processes, unlike ``hash()``), so site names can be
    coordinates.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(str(int(seed)).encode())
    for part in parts:
        h.update(b"\x1f")
        h.update(part.encode() if isinstance(part, str) else str(int(part)).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def rng_for(seed: int, *parts: int | str) -> np.random.Generator:
    """Return a NumPy generator for the coordinates ``parts`` of a run seeded ``seed``."""
    return np.random.default_rng(derive_seed(seed, *parts))
