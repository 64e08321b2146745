"""Reading an ArrayRecord in place gives what Flower's own decoding gives."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.arrays import array_view, record_to_arrays, record_views

DTYPES = st.sampled_from(
    ["<f4", ">f4", "<f2", "<f8", "<i1", ">i8", "<u2", "|b1", "<c8", "<U3", "|S2", "<M8[s]"]
)


@settings(max_examples=100, deadline=None)
@given(
    values=DTYPES.flatmap(
        lambda dtype: hnp.arrays(
            np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)
        )
    ),
    fortran=st.booleans(),
)
def test_a_view_equals_flowers_decoding(values: np.ndarray, fortran: bool) -> None:
    array = Array(np.asfortranarray(values) if fortran else values)
    view, decoded = array_view(array), array.numpy()
    assert view.dtype == decoded.dtype and view.shape == decoded.shape
    assert view.flags.f_contiguous == decoded.flags.f_contiguous
    assert view.tobytes(order="A") == decoded.tobytes(order="A")
    assert not view.flags.writeable  # the reply's own bytes
    assert view.size == 0 or np.shares_memory(view, np.frombuffer(array.data, np.uint8))


def test_a_record_reads_in_place_in_its_order() -> None:
    record = ArrayRecord(
        {"z": Array(np.arange(3, dtype=np.int64)), "a": Array(np.ones((2, 2), np.float16))}
    )
    views, decoded = record_views(record), record_to_arrays(record)
    assert list(views) == list(decoded) == ["z", "a"]
    for key in decoded:
        np.testing.assert_array_equal(views[key], decoded[key])


@pytest.mark.parametrize(
    "array",
    [
        # truncated data
        Array(
            dtype="float32", shape=(10,), stype="numpy.ndarray", data=Array(np.ones(10)).data[:100]
        ),
        # not .npy at all
        Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"not an array"),
        # an object array: Flower (numpy) refuses to unpickle it
        Array(
            dtype="object",
            shape=(1,),
            stype="numpy.ndarray",
            data=Array(np.ones(1)).data.replace(b"'<f8'", b"'|O' "),
        ),
        # a negative dimension (numpy refuses it; a view would read every value)
        Array(
            dtype="float32",
            shape=(4,),
            stype="numpy.ndarray",
            data=Array(np.ones(4, np.float32)).data.replace(b"(4,), }", b"(-1,),}"),
        ),
    ],
    ids=["truncated", "not-npy", "object", "negative-dimension"],
)
def test_what_flower_cannot_decode_fails_as_flower_fails(array: Array) -> None:
    with pytest.raises(Exception) as flower:
        array.numpy()
    with pytest.raises(type(flower.value), match=None) as ours:
        array_view(array)
    assert str(ours.value) == str(flower.value)


def test_short_and_odd_headers_take_flowers_path() -> None:
    ones = Array(np.ones(3, np.float32)).data
    for data in (ones[:6], ones[:7], ones[:9], ones[:6] + b"\x03\x00" + ones[8:]):
        array = Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data)
        with pytest.raises(Exception) as flower:
            array.numpy()
        with pytest.raises(type(flower.value)):
            array_view(array)
    # a version numpy reads but not through the public readers: Flower's path reads it
    minor = Array(
        dtype="float32", shape=(3,), stype="numpy.ndarray", data=ones[:7] + b"\x01" + ones[8:]
    )
    try:
        expected = minor.numpy()
    except Exception as exc:  # numpy refuses it: so must the view
        with pytest.raises(type(exc)):
            array_view(minor)
    else:
        np.testing.assert_array_equal(array_view(minor), expected)
