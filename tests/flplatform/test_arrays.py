"""Reading an ArrayRecord in place gives what Flower's own decoding gives."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.core.arrays import (
    array_view,
    arrays_to_record,
    encode,
    record_to_arrays,
    record_views,
)

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


# ------------------------------------------------------------------ encode
@settings(max_examples=150, deadline=None)
@given(
    values=hnp.arrays(
        dtype=st.sampled_from(
            [np.float32, np.float64, np.float16, np.int64, np.int8, np.uint16, np.bool_]
        ).map(np.dtype)
        | st.just(np.dtype(">f4")),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    fortran=st.booleans(),
)
def test_encode_writes_the_bytes_flower_writes(values: np.ndarray, fortran: bool) -> None:
    values = np.asfortranarray(values) if fortran else values
    ours, flowers = encode(values), Array(np.asarray(values, order="C"))
    assert ours.data == flowers.data
    assert (ours.dtype, ours.shape, ours.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    np.testing.assert_array_equal(ours.numpy(), values)


def test_encoding_a_view_of_an_array_gives_that_array_back_uncopied() -> None:
    original = Array(np.arange(6, dtype=np.float32).reshape(2, 3))
    view = array_view(original)
    assert encode(view) is original
    assert arrays_to_record({"w": view})["w"] is original
    # anything computed from the view is a new array and is encoded anew
    again = encode(view + 0)
    assert again is not original and again.data == original.data
    # a view of the view is not the view
    assert encode(view.reshape(-1)) is not original


def test_an_encoded_array_keeps_its_values_when_the_source_changes() -> None:
    source = np.ones(5, dtype=np.float32)
    encoded = encode(source)
    source[:] = 7.0
    np.testing.assert_array_equal(encoded.numpy(), np.ones(5, dtype=np.float32))


def test_a_dead_view_is_forgotten() -> None:
    import gc

    from flplatform.core import arrays as module

    view = array_view(Array(np.zeros(3, dtype=np.float32)))
    key = id(view)
    assert key in module._SOURCES
    del view
    gc.collect()
    assert key not in module._SOURCES


def test_an_array_encode_would_not_write_is_never_handed_on() -> None:
    exact = encode(np.arange(4, dtype=np.float32))
    # bytes beyond the data, and metadata that contradicts the header
    trailing = Array(
        dtype=exact.dtype, shape=exact.shape, stype=exact.stype, data=exact.data + b"!"
    )
    mislabelled = Array(dtype="int64", shape=(2, 2), stype=exact.stype, data=exact.data)
    for odd in (trailing, mislabelled):
        view = array_view(odd)
        again = encode(view)
        assert again is not odd and again.data == exact.data
    # an Array whose bytes were replaced after the view was taken is encoded anew
    source = encode(np.ones(3, dtype=np.float32))
    view = array_view(source)
    source.data = encode(np.zeros(3, dtype=np.float32)).data
    assert encode(view) is not source
    np.testing.assert_array_equal(encode(view).numpy(), np.ones(3, dtype=np.float32))
