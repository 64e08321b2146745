"""The byte digest against a naive word-by-word reference, and what it tells apart."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.engine.digest import KEY_WORDS, arrays_digest, digest

MASK = 2**64 - 1


def splitmix64(index: int) -> int:
    """SplitMix64's output for state (index + 1)·γ, as in its reference C code."""
    z = ((index + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def naive_digest(data: bytes) -> bytes:
    """h1 = Σ k_i w_i, h2 = Σ_j r_j Σ_{i in block j} k_i w_i (mod 2^64) over 32-bit words,
    one word at a time."""
    padded = data + b"\0" * (-len(data) % 4)
    words = [int.from_bytes(padded[i : i + 4], "little") for i in range(0, len(padded), 4)]
    blocks = [0] * (len(words) // KEY_WORDS + 1)
    for i, word in enumerate(words):
        key = splitmix64(i % KEY_WORDS) | 1
        blocks[i // KEY_WORDS] = (blocks[i // KEY_WORDS] + key * word) & MASK
    h1 = sum(blocks) & MASK
    h2 = sum((splitmix64(j + 2**32) | 1) * b for j, b in enumerate(blocks)) & MASK
    return b"".join(v.to_bytes(8, "little") for v in (len(data), h1, h2))


def test_the_keys_are_splitmix64s_published_sequence() -> None:
    # the first outputs of SplitMix64 seeded with 0 (Vigna's splitmix64.c)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(1) == 0x6E789E6AA1B965F4


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3 * 4 * KEY_WORDS + 13))
def test_digest_equals_the_naive_reference(data: bytes) -> None:
    assert digest(data) == naive_digest(data)


def test_digest_reads_any_contiguous_buffer_in_place() -> None:
    data = np.random.default_rng(0).normal(size=20_000).astype(np.float32).tobytes()
    view = memoryview(data)[5:70_005]  # an unaligned slice, as an array chunk can be
    assert digest(view) == digest(bytes(view)) == naive_digest(bytes(view))
    assert digest(bytearray(data)) == digest(data)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=4 * 8 * KEY_WORDS),
    position=st.integers(min_value=0),
    flip=st.integers(1, 255),
)
def test_one_changed_byte_changes_the_digest(data: bytes, position: int, flip: int) -> None:
    changed = bytearray(data)
    changed[position % len(data)] ^= flip
    assert digest(bytes(changed)) != digest(data)


def test_trailing_zeros_and_swapped_blocks_change_the_digest() -> None:
    assert digest(b"") != digest(b"\0") != digest(b"\0" * 8)
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 2**31, KEY_WORDS, dtype=np.uint32).tobytes() for _ in range(2)]
    # equal word keys within a block: h1 alone would not see the swap
    assert digest(blocks[0] + blocks[1]) != digest(blocks[1] + blocks[0])


def test_two_sign_flips_of_float64s_change_the_digest() -> None:
    # Differences of 2^63 in two 64-bit words: k·2^63 is 2^63 for every odd key, so a digest
    # over 64-bit words could not see them (an honest update was taken for a replay).
    values = np.random.default_rng(2).normal(size=1000)
    flipped = values.copy()
    flipped[[10, 20]] *= -1
    assert digest(flipped.tobytes()) != digest(values.tobytes())
    int8 = np.arange(64, dtype=np.int8)
    shifted = int8.copy()
    shifted[[7, 15]] ^= np.int8(-128)  # the top bit of two 64-bit words' last byte
    assert digest(shifted.tobytes()) != digest(int8.tobytes())


def record(**arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({name: Array(values) for name, values in arrays.items()})


def test_records_digest_equal_exactly_when_flower_gives_them_one_id() -> None:
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    same = record(w=weights, b=np.ones(4, np.float32))
    copy = record(w=weights.copy(), b=np.ones(4, np.float32))
    assert arrays_digest(same) == arrays_digest(copy)
    assert same.object_id == copy.object_id
    others = [
        record(b=np.ones(4, np.float32), w=weights),  # order
        record(w=weights, c=np.ones(4, np.float32)),  # a name
        record(w=weights.reshape(4, 3), b=np.ones(4, np.float32)),  # a shape
        record(w=weights.astype(np.float64), b=np.ones(4, np.float32)),  # a dtype
        record(w=weights + 1, b=np.ones(4, np.float32)),  # the data
    ]
    for other in others:
        assert other.object_id != same.object_id
        assert arrays_digest(other) != arrays_digest(same)
