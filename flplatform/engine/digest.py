"""A digest of bytes at memory speed, for telling equal payloads apart.

Flower names every object by the SHA-256 of its bytes. Its SuperLink has already hashed a
reply when the ServerApp pulls it, but hands the objects over without their ids, so reading
them back would hash every model a second time (about 2 ms per 4 MB here): more than
everything else the server does with a reply. Where the server only needs to know whether
two payloads are the same (identical chunks when metering, a site replaying its own
reply), this digest does in a tenth of the time.

It is linear, not cryptographic: the little-endian 32-bit words w_i of the data (each
taken as a 64-bit number), with fixed odd 64-bit keys k_i (period ``KEY_WORDS``) and r_j
(one per block of ``KEY_WORDS`` words), give
    h1 = Σ_i k_i w_i,    h2 = Σ_j r_j Σ_{i in block j} k_i w_i      (mod 2^64)
and the length. Equal bytes give equal digests; bytes that differ give the same one only
when the difference is in the kernel of both sums, which data nobody built for it does
not hit (a single changed word never: its key is odd). Words of 32 bits, not 64: a
difference of a word is then below 2^32, so the top bits of the keys take part; with
64-bit words two sign flips of float64s (differences of 2^63, and k·2^63 = 2^63 for every
odd k) gave one digest. Someone who wants a collision
can make one, so a digest is never the last word where that would matter: metering
confirms equal digests byte for byte, and the replay check only ever rejects a site's
update as a copy of its own.

NumPy only; the keys are a fixed function of their index (SplitMix64), so a digest is the
same on every machine and NumPy version (the update guard keeps digests in checkpoints).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # Flower's records are read, never built, here
    from flwr.app import ArrayRecord

KEY_WORDS = 4096  # 32 KiB of keys: one block of data is multiplied in cache
_WORD = np.dtype("<u4")
_WORD_BYTES = _WORD.itemsize


def _splitmix64(index: np.ndarray) -> np.ndarray:
    """SplitMix64's output for ``index`` (uint64), made odd."""
    with np.errstate(over="ignore"):
        z = (index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


_KEYS = _splitmix64(np.arange(KEY_WORDS, dtype=np.uint64))
# r_j: SplitMix64 from 2^32 on, a stretch the word keys never reach
_BLOCK_KEYS_FROM = np.uint64(1 << 32)


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """A 24-byte digest of ``data``: its length, h1 and h2 (see the module), little-endian.

    Reads ``data`` in place (any contiguous buffer; no copy of it is made). The last
    words, fewer than a block, are the last block; trailing bytes are a last word padded
    with zeros (the length tells such data apart).
    """
    view = memoryview(data).cast("B")
    size, words = len(view), len(view) // _WORD_BYTES
    blocks = words // KEY_WORDS
    body = np.frombuffer(view, dtype=_WORD, count=blocks * KEY_WORDS)
    rest = np.frombuffer(view, dtype=_WORD, count=words - body.size, offset=body.nbytes)
    tail = size % _WORD_BYTES
    padded = bytes(view[words * _WORD_BYTES :]).ljust(_WORD_BYTES, b"\0") if tail else b""
    last = np.concatenate([rest, np.frombuffer(padded, dtype=_WORD)]).astype(np.uint64)
    # Σ_{i in block j} k_i w_i for every block j (uint64 arithmetic wraps mod 2^64)
    per_block = np.append(
        np.einsum("ij,j->i", body.reshape(blocks, KEY_WORDS), _KEYS),
        np.dot(last, _KEYS[: last.size]),
    )
    block_keys = _block_keys(per_block.size)
    h1 = int(per_block.sum(dtype=np.uint64))
    h2 = int(np.dot(per_block, block_keys))
    return b"".join(value.to_bytes(8, "little") for value in (size, h1, h2))


# The per-block keys, a fixed function of the block's index: computed once, and again only
# for longer data (they cost more than half of a small array's digest).
_block_key_cache = _splitmix64(np.arange(1024, dtype=np.uint64) + _BLOCK_KEYS_FROM)


def _block_keys(count: int) -> np.ndarray:
    """The keys of blocks 0 .. count-1."""
    global _block_key_cache
    keys = _block_key_cache
    if keys.size < count:  # (rebinding is atomic: a concurrent caller sees either array)
        keys = _splitmix64(np.arange(2 * count, dtype=np.uint64) + _BLOCK_KEYS_FROM)
        _block_key_cache = keys
    return keys[:count]


def arrays_digest(record: ArrayRecord) -> str:
    """A digest of an ``ArrayRecord``: equal for records Flower would give one id (the same
    names in the same order, each array's dtype, shape, stype and data), hex."""
    summary = hashlib.sha256()
    for name, array in record.items():
        summary.update(json.dumps([name, array.dtype, array.shape, array.stype]).encode("utf-8"))
        summary.update(digest(array.data))
    return summary.hexdigest()
