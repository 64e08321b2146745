"""Site codecs against naive oracles, hand-computed golden cases and hostile wire input."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.run.start import start
from strategies.codecs import (
    TOPK_VALUES,
    Codec,
    ErrorFeedback,
    Identity,
    StochasticInt4,
    StochasticInt8,
    TopK,
    Wire,
    make_codec,
    quantize_int4,
    quantize_int8,
    wire_nbytes,
)
from strategies.layout import Layout, difference
from strategies.local_sgd import LocalSGDAveraging, codec_enlarges
from strategies.top_k import _magnitude_candidates, top_k_by_magnitude
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import replying_site

Arrays = dict[str, np.ndarray]


# ---------------------------------------------------------------- naive oracles
def naive_top_k(x: list[float], k: int) -> list[int]:
    """Rank every coordinate by (−|x_i|, i) in plain Python; keep k; ascending."""
    ranked: list[tuple[float, int]] = []
    for i, value in enumerate(x):
        ranked.append((-abs(value), i))
    ranked.sort()
    return sorted(i for _, i in ranked[:k])


def flat(arrays: Arrays) -> np.ndarray:
    """Float64 concatenation in sorted-name order (the documented layout order)."""
    return np.concatenate([np.asarray(arrays[n], np.float64).reshape(-1) for n in sorted(arrays)])


# ---------------------------------------------------------------- hypothesis strategies
NAMES = ["conv.weight", "fc.bias", "fc.weight", "head.weight"]
# small integers force ties and zeros; wide floats exercise the float32 path
ELEMENTS = st.one_of(
    st.integers(-3, 3).map(float),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32),
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5)


@st.composite
def layouts(draw: st.DrawFn, *, buffer: bool = False) -> dict[str, tuple[int, ...]]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    shapes = {n: draw(SHAPES) for n in names}
    if buffer:
        shapes["norm.num_batches_tracked"] = ()  # a 0-d int64 buffer, like BatchNorm's
        if draw(st.booleans()):  # a float one, sent exactly like the counter
            shapes["norm.running_var"] = draw(SHAPES)
    return shapes


def draw_update(draw: st.DrawFn, shapes: dict[str, tuple[int, ...]]) -> Arrays:
    out: Arrays = {}
    for name, shape in shapes.items():
        if name.endswith("num_batches_tracked"):
            out[name] = np.array(draw(st.integers(0, 50)), dtype=np.int64).reshape(shape)
        else:
            out[name] = draw(hnp.arrays(np.float32, shape, elements=ELEMENTS))
    return out


@st.composite
def updates(draw: st.DrawFn, *, buffer: bool = False) -> Arrays:
    return draw_update(draw, draw(layouts(buffer=buffer)))


@st.composite
def update_sequences(draw: st.DrawFn) -> list[Arrays]:
    shapes = draw(layouts(buffer=draw(st.booleans())))
    return [draw_update(draw, shapes) for _ in range(draw(st.integers(1, 6)))]


@st.composite
def top_ks(draw: st.DrawFn) -> TopK:
    if draw(st.booleans()):
        return TopK(k=draw(st.integers(1, 80)))
    return TopK(fraction=draw(st.floats(0.001, 1.0)))


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- layout
def test_layout_orders_by_name_and_round_trips_dtypes() -> None:
    arrays: Arrays = {
        "b": np.array([[1.5, -2.0]], dtype=np.float32),
        "a": np.array([7, -3], dtype=np.int64),
        "c": np.array(True),
        "d": np.array([0.25], dtype=np.float64),
    }
    layout = Layout.of(arrays)
    assert layout.names == ("a", "b", "c", "d")
    assert layout.shapes == ((2,), (1, 2), (), (1,))
    assert layout.size == 6 and layout.offsets == (0, 2, 4, 5)
    vector = layout.flatten(arrays)
    assert vector.dtype == np.float64
    np.testing.assert_array_equal(vector, [7, -3, 1.5, -2.0, 1.0, 0.25])
    back = layout.unflatten(vector)
    for name, value in arrays.items():
        assert isinstance(back[name], np.ndarray)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)


def test_layout_unflatten_rounds_integers_and_rejects_overflow() -> None:
    layout = Layout.of({"n": np.zeros(2, dtype=np.int8)})
    np.testing.assert_array_equal(layout.unflatten(np.array([2.6, -1.4]))["n"], [3, -1])
    with pytest.raises(ValueError, match="outside the range of int8"):
        layout.unflatten(np.array([128.0, 0.0]))


def test_layout_rejects_mismatched_arrays() -> None:
    layout = Layout.of({"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="missing \\['w'\\], extra \\['v'\\]"):
        layout.flatten({"v": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="shape"):
        layout.flatten({"w": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="shape"):
        layout.unflatten(np.zeros(5))
    with pytest.raises(ValueError, match="real numbers"):
        Layout.of({"z": np.zeros(2, np.complex64)})


# ---------------------------------------------------------------- top-k
def test_topk_golden_by_hand() -> None:
    # layout order is by name: a (2 × 2) then b, whatever the dict order
    update: Arrays = {
        "b": np.array([3.0, -1.0, 2.0], dtype=np.float32),
        "a": np.array([[0.5, -3.0], [2.0, 0.0]], dtype=np.float32),
    }
    # flat: [0.5, −3, 2, 0 | 3, −1, 2]; |x| = 3 at 1 and 4, then a tie of 2 at 2 and 6:
    # the lower index (2) wins
    wire = TopK(k=3).encode(update, rng=rng())
    assert wire["topk.indices"].dtype == np.int32
    assert wire["topk.values"].dtype == np.float32
    np.testing.assert_array_equal(wire["topk.indices"], [1, 2, 4])
    np.testing.assert_array_equal(wire["topk.values"], [-3.0, 2.0, 3.0])
    dense = TopK(k=3).decode(wire, Layout.of(update))
    np.testing.assert_array_equal(dense["a"], [[0.0, -3.0], [2.0, 0.0]])
    np.testing.assert_array_equal(dense["b"], [3.0, 0.0, 0.0])
    assert dense["a"].dtype == np.float32
    assert wire_nbytes(wire) == 3 * 4 + 3 * 4


@settings(max_examples=150, deadline=None)
@given(update=updates(buffer=True), codec=top_ks())
def test_topk_matches_naive_oracle(update: Arrays, codec: TopK) -> None:
    x = flat(update)
    k = codec.k_for(x.size)
    wire = codec.encode(update, rng=rng())
    # A BatchNorm's counter and running variance, when drawn, are never selected: they
    # travel exactly beside the selection.
    exact = [n for n in update if n.startswith("norm.")]
    selectable = x.copy()
    for name in exact:
        start, stop = Layout.of(update).span(name)
        selectable[start:stop] = 0
    expected = naive_top_k(selectable.tolist(), k)
    assert wire["topk.indices"].tolist() == expected
    np.testing.assert_array_equal(wire["topk.values"], selectable[expected].astype(np.float32))
    decoded = codec.decode(wire, Layout.of(update))
    assert all(isinstance(v, np.ndarray) for v in decoded.values())
    dense = flat(decoded)
    want = np.zeros_like(x)
    want[expected] = selectable[expected].astype(np.float32)
    for name in exact:
        start, stop = Layout.of(update).span(name)
        want[start:stop] = x[start:stop]
        assert decoded[name].dtype == update[name].dtype
    np.testing.assert_array_equal(dense, want)


@settings(max_examples=150, deadline=None)
@given(
    x=hnp.arrays(np.float64, st.integers(1, 300), elements=ELEMENTS),
    k=st.integers(1, 40),
    sample=st.integers(1, 64),
)
def test_top_k_by_magnitude_with_any_sample_size_matches_naive(
    x: np.ndarray, k: int, sample: int
) -> None:
    # small samples take the sampled-threshold path, including its fallback
    got = top_k_by_magnitude(x, k, sample=sample)
    assert got.dtype == np.int64
    assert got.tolist() == naive_top_k(x.tolist(), k)


def test_sampled_threshold_path_is_taken_and_exact() -> None:
    x = rng(3).standard_normal(50_000)
    x[[10, 20, 30]] = 9.0  # a three-way tie inside the top-k
    cand = _magnitude_candidates(np.abs(x), 100, 1024)
    assert cand is not None and 100 <= cand.size < 1_000
    got = top_k_by_magnitude(x, 100, sample=1024)
    np.testing.assert_array_equal(got, top_k_by_magnitude(x, 100, sample=x.size))  # no sample
    assert got.tolist() == naive_top_k(x.tolist(), 100)


def test_unlucky_sample_falls_back_to_the_full_partition() -> None:
    # the stride-16 sample sees only the 64 tens, so its guess keeps fewer than k candidates
    x = rng(4).uniform(-1, 1, 1024)
    x[::16] = 10.0
    assert _magnitude_candidates(np.abs(x), 100, 64) is None
    assert top_k_by_magnitude(x, 100, sample=64).tolist() == naive_top_k(x.tolist(), 100)


def test_topk_with_k_at_least_d_sends_the_exact_update() -> None:
    update: Arrays = {
        "w": rng(1).standard_normal((4, 3)).astype(np.float32),
        "n": np.array(5, dtype=np.int64),
    }
    layout = Layout.of(update)
    for codec in (TopK(k=13), TopK(k=10**6), TopK(fraction=1.0)):
        assert codec.k_for(layout.size) == 13
        dense = codec.decode(codec.encode(update, rng=rng()), layout)
        for name, value in update.items():
            assert dense[name].dtype == value.dtype
            np.testing.assert_array_equal(dense[name], value)


def test_topk_k_from_fraction() -> None:
    assert TopK(fraction=0.01).k_for(1_000_000) == 10_000
    assert TopK(fraction=0.01).k_for(10) == 1  # at least one coordinate
    assert TopK(fraction=0.25).k_for(10) == 2  # round(2.5) = 2
    assert TopK(k=5).k_for(3) == 3


def test_topk_uses_int64_indices_from_two_to_the_31() -> None:
    # checked from the wire's dtype alone: nothing of size 2^31 is allocated
    huge = Layout(names=("w",), shapes=((2**31,),), dtypes=(np.dtype(np.float32),))
    wire = {"topk.indices": np.array([0, 1], np.int32), "topk.values": np.ones(2, np.float32)}
    with pytest.raises(UpdateRejected, match="dtype int32, expected int64"):
        TopK(k=2).decode(wire, huge)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"k": 3, "fraction": 0.1}, "exactly one"),
        ({"k": 0}, "k must be an integer >= 1"),
        ({"k": True}, "k must be an integer >= 1"),
        ({"k": 2.0}, "k must be an integer >= 1"),
        ({"fraction": 0.0}, "fraction must be in \\(0, 1\\]"),
        ({"fraction": 1.5}, "fraction must be in \\(0, 1\\]"),
        ({"fraction": float("nan")}, "fraction must be in \\(0, 1\\]"),
    ],
)
def test_topk_rejects_bad_settings(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TopK(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- stochastic int8
def test_int8_golden_by_hand() -> None:
    # default_rng(0).random(4) draws these uniforms (one per element, in C order)
    u = [0.6369616873214543, 0.2697867137638703, 0.04097352393619469, 0.016527635528529094]
    np.testing.assert_array_equal(rng(0).random(4), u)
    x = np.array([0.5, -1.0, 0.25, 0.0], dtype=np.float32)
    # s = 1; y = 127·x = [63.5, −127, 31.75, 0]; round up iff U < frac(y) = [.5, 0, .75, 0]:
    # 0.637 < .5 no → 63; never for −127 and 0; 0.041 < .75 yes → 32
    wire = StochasticInt8().encode({"w": x}, rng=rng(0))
    assert set(wire) == {"int8.w", "int8.w.scale"}
    assert wire["int8.w"].dtype == np.int8 and wire["int8.w.scale"].dtype == np.float32
    np.testing.assert_array_equal(wire["int8.w"], [63, -127, 32, 0])
    np.testing.assert_array_equal(wire["int8.w.scale"], [1.0])
    dense = StochasticInt8().decode(wire, Layout.of({"w": x}))["w"]
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense, np.array([63 / 127, -1.0, 32 / 127, 0.0], np.float32))
    assert wire_nbytes(wire) == 4 + 4


def one_level(codec: Codec, x: np.ndarray) -> np.ndarray:
    """The quantizing ``codec``'s level (the step between codes) at each element of x."""
    wire = codec.encode({"w": x}, rng=rng())
    if isinstance(codec, StochasticInt8):
        return np.full(x.size, float(wire["int8.w.scale"][0]) / 127)
    return np.repeat(wire["int4.w.scale"].astype(np.float64) / 7, 64)[: x.size]


@pytest.mark.parametrize(
    ("codec", "size"),
    [(StochasticInt8(), 41), (StochasticInt4(), 70)],  # int4: two blocks, 64 and 6
    ids=["int8", "int4"],
)
def test_quantizers_are_unbiased(codec: Codec, size: int) -> None:
    x = np.linspace(-0.8, 1.3, size).astype(np.float32)  # max |x| = 1.3 sets a scale
    n = 3000
    layout = Layout.of({"w": x})
    decoded = np.stack(
        [
            codec.decode(codec.encode({"w": x}, rng=rng(seed)), layout)["w"].astype(np.float64)
            for seed in range(n)
        ]
    )  # (n, size)
    level = one_level(codec, x)
    y = x.astype(np.float64) / level
    f = y - np.floor(y)
    # one decode is ⌊y⌋ or ⌊y⌋ + 1 levels with P = f: variance level²·f(1 − f)
    standard_error = level * np.sqrt(f * (1 - f) / n)
    error = np.abs(decoded.mean(axis=0) - x)
    assert (error <= 5 * standard_error + 1e-6 * level).all(), error / (standard_error + 1e-12)
    # rounding to nearest would be off by up to half a level, far outside 5 standard errors
    assert 5 * standard_error.max() < 0.1 * level.min()


@settings(max_examples=100, deadline=None)
@given(update=updates(buffer=True), seed=st.integers(0, 2**32))
def test_int8_error_is_below_one_level(update: Arrays, seed: int) -> None:
    codec = StochasticInt8()
    wire = codec.encode(update, rng=rng(seed))
    dense = codec.decode(wire, Layout.of(update))
    for name, x in update.items():
        assert isinstance(dense[name], np.ndarray) and dense[name].shape == x.shape
        if name.startswith("norm."):  # the counter and the running variance: exactly
            carrier = "averaged/float64" if x.dtype.kind != "f" else "averaged/float32"
            assert carrier in wire and f"int8.{name}" not in wire
            np.testing.assert_array_equal(dense[name], x)
            continue
        s = float(wire[f"int8.{name}.scale"][0])
        assert s >= float(np.max(np.abs(x)))  # the scale covers every element
        # one level s/127, plus the rounding of q·s/127 to float32
        bound = s / 127 + np.spacing(np.float32(s))
        assert (np.abs(dense[name].astype(np.float64) - x) <= bound).all()


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(1, 200), elements=ELEMENTS),
    chunk=st.integers(1, 70),
    seed=st.integers(0, 2**32),
)
def test_int8_codes_do_not_depend_on_the_chunk(x: np.ndarray, chunk: int, seed: int) -> None:
    q_one, s_one = quantize_int8(x, rng(seed), chunk=x.size)
    q_chunked, s_chunked = quantize_int8(x, rng(seed), chunk=chunk)
    assert s_one == s_chunked
    np.testing.assert_array_equal(q_one, q_chunked)


def test_int8_zero_array_has_scale_zero_and_draws_nothing() -> None:
    generator = rng(5)
    before = generator.bit_generator.state
    wire = StochasticInt8().encode({"w": np.zeros((2, 3), np.float32)}, rng=generator)
    assert generator.bit_generator.state == before
    np.testing.assert_array_equal(wire["int8.w.scale"], [0.0])
    np.testing.assert_array_equal(wire["int8.w"], np.zeros((2, 3), np.int8))
    dense = StochasticInt8().decode(wire, Layout.of({"w": np.zeros((2, 3), np.float32)}))
    np.testing.assert_array_equal(dense["w"], np.zeros((2, 3), np.float32))


def test_int8_passes_integer_and_bool_buffers_exactly() -> None:
    update: Arrays = {
        "n": np.array(2**40 + 3, dtype=np.int64),  # not representable in float32
        "m": np.array([-7, 9], dtype=np.int32),
        "flag": np.array([True, False]),
        "w": np.array([0.1, -0.2], dtype=np.float32),
    }
    wire = StochasticInt8().encode(update, rng=rng())
    # one float64 vector for the three, exact (n needs more than float32's 24 bits)
    assert set(wire) == {"averaged/float64", "int8.w", "int8.w.scale"}
    assert wire["averaged/float64"].tolist() == [1, 0, -7, 9, 2**40 + 3]  # flag, m, n
    dense = StochasticInt8().decode(wire, Layout.of(update))
    for name in ("n", "m", "flag"):
        assert dense[name].dtype == update[name].dtype
        np.testing.assert_array_equal(dense[name], update[name])


def test_int8_scale_is_rounded_up_to_cover_float64_input() -> None:
    x = np.array([1.0 + 2.0**-30, -0.5])  # max |x| is not a float32: s must not fall below
    q, s = quantize_int8(x, rng())
    assert float(s) > 1.0 and s.dtype == np.float32
    assert q.min() >= -127 and q.max() <= 127


def test_int8_refuses_models_whose_wire_keys_collide() -> None:
    model: Arrays = {"x": np.ones(2, np.float32), "x.scale": np.ones(1, np.float32)}
    with pytest.raises(ConfigError, match="wire keys \\['int8.x.scale'\\] collide"):
        StochasticInt8().encode(model, rng=rng())
    with pytest.raises(ConfigError, match="collide"):
        StochasticInt8().decode({}, Layout.of(model))
    # an integer 'x.scale' travels exactly, in averaged/float64: no clash
    model["x.scale"] = np.ones(1, np.int64)
    wire = StochasticInt8().encode(model, rng=rng())
    StochasticInt8().decode(wire, Layout.of(model))


# ---------------------------------------------------------------- int4
def naive_int4(x: np.ndarray, uniforms: np.ndarray) -> tuple[list[int], list[float]]:
    """Block by block and element by element: the levels q and the float32 scales."""
    flat = [float(v) for v in np.asarray(x, np.float64).reshape(-1)]
    levels, scales = [], []
    for first in range(0, len(flat), 64):
        block = flat[first : first + 64]
        m = max(abs(v) for v in block)
        s = np.float32(m)
        if float(s) < m:
            s = np.nextafter(s, np.float32(np.inf))
        scales.append(float(s))
        for i, v in enumerate(block, first):
            y = 0.0 if s == 0 else v / float(s) * 7
            low = math.floor(y)
            levels.append(low + (1 if uniforms[i] < y - low else 0))
    return levels, scales


def test_int4_golden_by_hand() -> None:
    # default_rng(0).random(5): 0.637, 0.270, 0.041, 0.017, 0.813 (one per element)
    u = rng(0).random(5)
    x = np.array([0.5, -1.0, 0.25, 0.0, 0.9], dtype=np.float32)
    # one block, s = 1; y = 7·x = [3.5, −7, 1.75, 0, 6.3]; up iff U < frac(y) =
    # [.5, 0, .75, 0, .3]: 0.637 no → 3; −7; 0.041 yes → 2; 0; 0.813 no → 6.
    # Nibbles q + 8 = [11, 1, 10, 8, 14, 8 (padding)]: bytes 11 | 1 << 4 = 27,
    # 10 | 8 << 4 = 138, 14 | 8 << 4 = 142.
    assert u[2] < 0.75 and u[0] > 0.5 and u[4] > 0.3
    wire = StochasticInt4().encode({"w": x}, rng=rng(0))
    assert set(wire) == {"int4.w", "int4.w.scale"}
    assert wire["int4.w"].dtype == np.uint8 and wire["int4.w.scale"].dtype == np.float32
    np.testing.assert_array_equal(wire["int4.w"], [27, 138, 142])
    np.testing.assert_array_equal(wire["int4.w.scale"], [1.0])
    dense = StochasticInt4().decode(wire, Layout.of({"w": x}))["w"]
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense, np.array([3, -7, 2, 0, 6], np.float32) / 7)
    assert wire_nbytes(wire) == 3 + 4


@settings(max_examples=80, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(0, 300), elements=ELEMENTS),
    seed=st.integers(0, 2**32),
)
def test_int4_matches_the_naive_rule_and_packs_two_a_byte(x: np.ndarray, seed: int) -> None:
    codes, scales = quantize_int4(x, rng(seed), chunk=128)
    levels, naive_scales = naive_int4(x, rng(seed).random(x.size))
    assert codes.dtype == np.uint8 and codes.size == (x.size + 1) // 2
    assert scales.tolist() == naive_scales
    nibbles = [int(n) for byte in codes for n in (byte & 15, byte >> 4)]
    assert nibbles[: x.size] == [q + 8 for q in levels]
    assert nibbles[x.size :] == [8] * (len(nibbles) - x.size)  # padding is level 0
    assert all(-7 <= q <= 7 for q in levels)
    whole, whole_scales = quantize_int4(x, rng(seed))  # the chunk changes nothing
    np.testing.assert_array_equal(whole, codes)
    np.testing.assert_array_equal(whole_scales, scales)


@settings(max_examples=100, deadline=None)
@given(update=updates(buffer=True), seed=st.integers(0, 2**32))
def test_int4_error_is_below_one_level_of_its_block(update: Arrays, seed: int) -> None:
    codec = StochasticInt4()
    wire = codec.encode(update, rng=rng(seed))
    dense = codec.decode(wire, Layout.of(update))
    for name, x in update.items():
        assert dense[name].shape == x.shape and dense[name].dtype == x.dtype
        if name.startswith("norm."):  # the counter and the running variance: exactly
            assert f"int4.{name}" not in wire
            np.testing.assert_array_equal(dense[name], x)
            continue
        step = np.repeat(wire[f"int4.{name}.scale"].astype(np.float64) / 7, 64)[: x.size]
        flat = x.astype(np.float64).reshape(-1)
        bound = step + np.spacing(np.float32(step.max() * 7))
        assert (np.abs(dense[name].astype(np.float64).reshape(-1) - flat) <= bound).all()


@st.composite
def quantizer_inputs(draw: st.DrawFn) -> np.ndarray:
    """An array of float16, float32 or float64 whose values a float32 scale covers, zeros
    (signed) and whole zero blocks among them."""
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    # within the dtype and within a float32 scale (beyond, the quantizers refuse)
    top = float(np.finfo(np.float16 if dtype == np.float16 else np.float32).max) / 2
    elements = st.one_of(
        st.sampled_from([0.0, -0.0, 1.0, -3.0]),
        st.floats(-top, top, allow_nan=False, width=8 * np.dtype(dtype).itemsize),
    )
    x = draw(hnp.arrays(np.float64, st.integers(0, 300), elements=elements)).astype(dtype)
    if x.size and draw(st.booleans()):  # a block (or the whole array) of zeros
        first = draw(st.integers(0, x.size - 1))
        x[first : first + 64] = draw(st.sampled_from([0.0, -0.0]))
    return x


@settings(max_examples=150, deadline=None)
@given(
    x=quantizer_inputs(),
    codec=st.sampled_from(["int8", "int4"]),
    dense=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_quantizers_give_what_decode_gives_and_take_it_from_the_residual(
    x: np.ndarray, codec: str, dense: bool, seed: int
) -> None:
    """Error feedback's shortcut: the values a quantizer writes as it makes the codes are
    exactly (to the bit, signed zeros included) what the codec's decode gives from them,
    and the residual loses exactly those, also when only the residual is asked for."""
    before = rng(seed + 1).standard_normal(x.size)
    before[::7] = -0.0
    decoded = np.empty(x.size, x.dtype) if dense else None
    residual = before.copy()
    quantize = quantize_int8 if codec == "int8" else quantize_int4
    codes, scales = quantize(x, rng(seed), chunk=128, decoded=decoded, residual=residual)
    plain = quantize(x, rng(seed), chunk=128)  # the outputs change no code
    np.testing.assert_array_equal(codes, plain[0])
    np.testing.assert_array_equal(scales, plain[1])
    prefix = f"{codec}.w"
    wire = {prefix: codes, prefix + ".scale": np.atleast_1d(np.float32(scales))}
    with np.errstate(over="ignore"):
        want = make_codec(codec).decode(wire, Layout.of({"w": x}))["w"]
    assert want.dtype == x.dtype
    if decoded is not None:
        assert decoded.tobytes() == want.tobytes()
    assert residual.tobytes() == (before - want.astype(np.float64)).tobytes()


def test_int4_refuses_models_whose_wire_keys_collide() -> None:
    model: Arrays = {"x": np.ones(2, np.float32), "x.scale": np.ones(1, np.float32)}
    with pytest.raises(ConfigError, match="int4 cannot encode this model: wire keys"):
        StochasticInt4().encode(model, rng=rng())


def test_same_seed_gives_the_same_wire() -> None:
    update = {"w": rng(9).standard_normal(1000).astype(np.float32)}
    for codec in (StochasticInt8(), StochasticInt4(), TopK(fraction=0.1), Identity()):
        a, b = codec.encode(update, rng=rng(4)), codec.encode(update, rng=rng(4))
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    c, d = (StochasticInt8().encode(update, rng=rng(s))["int8.w"] for s in (4, 5))
    assert not np.array_equal(c, d)  # the rounding really is random
    # top-k ignores the generator
    np.testing.assert_array_equal(
        TopK(k=5).encode(update, rng=rng(1))["topk.indices"],
        TopK(k=5).encode(update, rng=rng(2))["topk.indices"],
    )


def test_encode_refuses_non_finite_updates() -> None:
    bad: Arrays = {"w": np.array([1.0, np.nan], np.float32)}
    for codec in (TopK(k=1), StochasticInt8(), StochasticInt4(), Identity()):
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode(bad, rng=rng())


# ---------------------------------------------------------------- error feedback
@settings(max_examples=120, deadline=None)
@given(
    sequence=update_sequences(),
    codec=st.one_of(top_ks(), st.just(StochasticInt8()), st.just(StochasticInt4())),
    seed=st.integers(0, 2**32),
)
def test_sent_plus_residual_equals_sum_of_true_updates(
    sequence: list[Arrays], codec: Codec, seed: int
) -> None:
    feedback = ErrorFeedback()
    generator = rng(seed)
    layout = Layout.of(sequence[0])
    sent_total = np.zeros(layout.size)
    true_total = np.zeros(layout.size)
    for update in sequence:
        wire, sent = feedback.compress(update, codec, rng=generator)
        for name, value in update.items():
            assert isinstance(sent[name], np.ndarray)  # 0-d buffers stay arrays, not scalars
            assert sent[name].dtype == value.dtype and sent[name].shape == value.shape
        sent_total += flat(sent)
        true_total += flat(update)
        residual = layout.flatten(feedback.residual)
        # float64 tolerance: far below one float32 rounding of the update
        scale = 1.0 + np.abs(true_total).max() + np.abs(sent_total).max()
        np.testing.assert_allclose(sent_total + residual, true_total, rtol=0, atol=1e-12 * scale)
    assert all(v.dtype == np.float64 for v in feedback.residual.values())


def test_sent_dense_is_what_the_server_decodes() -> None:
    update: Arrays = {
        "b": rng(2).standard_normal(50).astype(np.float32),
        "a": np.ones(3, np.float32),
    }
    server_model: Arrays = {
        "a": np.zeros(3, np.float32),
        "b": np.zeros(50, np.float32),
    }  # other order
    for codec in (TopK(k=7), StochasticInt8(), StochasticInt4(), Identity()):
        feedback = ErrorFeedback()
        for seed in range(3):
            wire, sent = feedback.compress(update, codec, rng=rng(seed))
            on_server = codec.decode(wire, Layout.of(server_model))
            for name in update:
                np.testing.assert_array_equal(on_server[name], sent[name])


def test_error_feedback_topk_golden_by_hand() -> None:
    feedback, codec = ErrorFeedback(), TopK(k=1)
    # round 1: u = [3, 1] → send 3 at 0; e = [0, 1]
    _, sent = feedback.compress({"w": np.array([3.0, 1.0], np.float32)}, codec, rng=rng())
    np.testing.assert_array_equal(sent["w"], [3.0, 0.0])
    np.testing.assert_array_equal(feedback.residual["w"], [0.0, 1.0])
    # round 2: u = [0.5, 1] → v = [0.5, 2] → send 2 at 1; e = [0.5, 0]
    _, sent = feedback.compress({"w": np.array([0.5, 1.0], np.float32)}, codec, rng=rng())
    np.testing.assert_array_equal(sent["w"], [0.0, 2.0])
    np.testing.assert_array_equal(feedback.residual["w"], [0.5, 0.0])
    assert feedback.norm() == 0.5


def test_error_feedback_keeps_float32_rounding_in_the_residual() -> None:
    # 0.1 is not a float32: the value sent is float32(0.1 + 0.1 + ...) and e holds the rest
    feedback = ErrorFeedback()
    u = {"w": np.array([0.1], np.float64)}
    _, sent = feedback.compress(u, TopK(k=1), rng=rng())
    assert sent["w"].dtype == np.float64  # the update's dtype
    assert sent["w"][0] == float(np.float32(0.1))
    assert feedback.residual["w"][0] == 0.1 - float(np.float32(0.1)) != 0.0


def test_identity_residual_stays_exactly_zero() -> None:
    feedback = ErrorFeedback()
    for seed in range(4):
        update: Arrays = {
            "w": rng(seed).standard_normal((3, 4)).astype(np.float32),
            "n": np.array(seed, np.int64),
        }
        wire, sent = feedback.compress(update, Identity(), rng=rng(seed))
        assert set(wire) == {"raw.w", "raw.n"}
        for name, value in update.items():
            np.testing.assert_array_equal(sent[name], value)
            assert sent[name].dtype == value.dtype
        assert all(not v.any() for v in feedback.residual.values())
    assert feedback.norm() == 0.0


def test_error_feedback_resumes_from_state_dict() -> None:
    updates = [{"w": rng(s).standard_normal(40).astype(np.float32)} for s in range(6)]
    codec = StochasticInt8()

    def run(feedback: ErrorFeedback, batch: list[Arrays], generator: np.random.Generator):
        return [feedback.compress(u, codec, rng=generator)[0]["int8.w"] for u in batch]

    straight = run(ErrorFeedback(), updates, rng(0))
    first = ErrorFeedback()
    generator = rng(0)
    resumed = run(first, updates[:3], generator)
    state = first.state_dict()
    assert set(state) == {"residual.w"} and state["residual.w"].dtype == np.float64
    second = ErrorFeedback()
    second.load_state_dict(state)
    resumed += run(second, updates[3:], generator)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_error_feedback_state_is_validated_all_at_once() -> None:
    feedback = ErrorFeedback()
    bad: Arrays = {
        "residual.w": np.array([np.nan]),
        "residual.n": np.array([1, 2]),
        "velocity.w": np.zeros(2),
    }
    with pytest.raises(ConfigError, match="NaN.*float array.*unexpected key 'velocity.w'"):
        feedback.load_state_dict(bad)
    assert feedback.residual == {}


def test_error_feedback_layout_change_needs_reset() -> None:
    feedback = ErrorFeedback()
    feedback.compress({"w": np.ones(4, np.float32)}, TopK(k=1), rng=rng())
    with pytest.raises(ValueError, match="reset"):
        feedback.compress({"w": np.ones(5, np.float32)}, TopK(k=1), rng=rng())
    feedback.reset()
    assert feedback.residual == {}
    feedback.compress({"w": np.ones(5, np.float32)}, TopK(k=1), rng=rng())


def test_failed_encode_leaves_the_residual_alone() -> None:
    feedback = ErrorFeedback()
    feedback.compress({"w": np.array([2.0, 1.0], np.float32)}, TopK(k=1), rng=rng())
    with pytest.raises(ValueError, match="NaN"):
        feedback.compress({"w": np.array([np.nan, 1.0], np.float32)}, TopK(k=1), rng=rng())
    np.testing.assert_array_equal(feedback.residual["w"], [0.0, 1.0])


# ---------------------------------------------------------------- hostile wire input
MODEL: Arrays = {
    "w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "n": np.array(7, dtype=np.int64),
}
LAYOUT = Layout.of(MODEL)  # d = 13: n at 0, w at 1..12
Mutation = Callable[[dict[str, object]], None]


def _set(key: str, value: object) -> Mutation:
    def mutate(wire: dict[str, object]) -> None:
        wire[key] = value

    return mutate


def _edit(key: str, fn: Callable[[np.ndarray], None]) -> Mutation:
    def mutate(wire: dict[str, object]) -> None:
        value = np.array(wire[key])
        fn(value)
        wire[key] = value

    return mutate


def _drop(key: str) -> Mutation:
    def mutate(wire: dict[str, object]) -> None:
        del wire[key]

    return mutate


def _index(i: int, value: int) -> Callable[[np.ndarray], None]:
    def fn(a: np.ndarray) -> None:
        a[i] = value

    return fn


TOPK_ATTACKS: list[tuple[str, Mutation, str]] = [
    ("index = d", _edit("topk.indices", _index(-1, 13)), "out of range \\[0, 13\\): 13"),
    ("huge index", _edit("topk.indices", _index(-1, 2**31 - 1)), "out of range"),
    ("negative index", _edit("topk.indices", _index(0, -1)), "negative index"),
    ("duplicate", _edit("topk.indices", lambda a: a.__setitem__(1, a[0])), "duplicate index"),
    ("unsorted", _set("topk.indices", np.array([5, 1, 9], np.int32)), "sorted ascending"),
    ("short values", _set("topk.values", np.ones(2, np.float32)), "shape \\(2,\\)"),
    ("more than k", _set("topk.indices", np.arange(4, dtype=np.int32)), "expected \\(3,\\)"),
    ("2-D indices", _set("topk.indices", np.ones((3, 1), np.int32)), "shape"),
    ("NaN value", _edit("topk.values", _index(0, np.nan)), "contains NaN"),  # type: ignore[arg-type]
    ("inf value", _edit("topk.values", _index(2, np.inf)), "NaN or Inf"),  # type: ignore[arg-type]
    ("int64 indices", _set("topk.indices", np.array([1, 2, 3])), "dtype int64, expected int32"),
    ("float indices", _set("topk.indices", np.array([1.0, 2, 3], np.float32)), "dtype"),
    ("float64 values", _set("topk.values", np.ones(3)), "dtype float64, expected float32"),
    ("list values", _set("topk.values", [1.0, 2.0, 3.0]), "must be an array, got list"),
    (
        "masked NaN",
        _set("topk.values", np.ma.masked_invalid(np.array([np.nan, 1, 2], np.float32))),
        "must be an array, got MaskedArray",
    ),
    ("missing", _drop("topk.values"), "missing arrays: topk.values"),
    ("extra", _set("topk.norm", np.ones(1, np.float32)), "unexpected arrays: topk.norm"),
    (
        "buffer overflow",
        lambda w: w.update(
            {
                "topk.indices": np.array([0, 1, 2], np.int32),
                "topk.values": np.array([1e30, 0, 0], np.float32),
            }
        ),
        "outside the range of int64",
    ),
]
INT8_ATTACKS: list[tuple[str, Mutation, str]] = [
    ("NaN scale", _set("int8.w.scale", np.array([np.nan], np.float32)), "finite and >= 0, got nan"),
    ("inf scale", _set("int8.w.scale", np.array([np.inf], np.float32)), "finite and >= 0, got inf"),
    (
        "negative scale",
        _set("int8.w.scale", np.array([-1.0], np.float32)),
        "finite and >= 0, got -1",
    ),
    ("float64 scale", _set("int8.w.scale", np.array([1.0])), "dtype float64, expected float32"),
    (
        "two scales",
        _set("int8.w.scale", np.array([1, 2], np.float32)),
        "shape \\(2,\\), expected \\(1,\\)",
    ),
    ("int16 codes", _set("int8.w", np.zeros((3, 4), np.int16)), "dtype int16, expected int8"),
    ("flat codes", _set("int8.w", np.zeros(12, np.int8)), "shape \\(12,\\), expected \\(3, 4\\)"),
    ("code -128", _edit("int8.w", _index(0, -128)), "code -128 outside \\[-127, 127\\]"),
    (
        "codes with zero scale",
        _set("int8.w.scale", np.array([0.0], np.float32)),
        "non-zero codes with scale 0",
    ),
    ("missing scale", _drop("int8.w.scale"), "missing arrays: int8.w.scale"),
    ("extra", _set("int8.n", np.zeros((), np.int8)), "unexpected arrays: int8.n"),
]
INT4_ATTACKS: list[tuple[str, Mutation, str]] = [
    ("NaN scale", _set("int4.w.scale", np.array([np.nan], np.float32)), "finite and >= 0"),
    ("negative scale", _set("int4.w.scale", np.array([-1.0], np.float32)), "finite and >= 0"),
    ("two scales", _set("int4.w.scale", np.ones(2, np.float32)), "expected \\(1,\\)"),
    ("int8 codes", _set("int4.w", np.full(6, 0x11, np.int8)), "dtype int8, expected uint8"),
    ("a byte too many", _set("int4.w", np.full(7, 0x88, np.uint8)), "expected \\(6,\\)"),
    ("level -8 low", _edit("int4.w", _index(0, 0x80)), "nibble 0 \\(level -8\\)"),
    ("level -8 high", _edit("int4.w", _index(5, 0x08)), "nibble 0 \\(level -8\\)"),
    (
        "codes with zero scale",
        lambda w: w.update(
            {"int4.w": np.full(6, 0x89, np.uint8), "int4.w.scale": np.zeros(1, np.float32)}
        ),
        "non-zero codes in a block of scale 0",
    ),
    ("missing scale", _drop("int4.w.scale"), "missing arrays: int4.w.scale"),
]
# The counter n travels exactly beside either codec's compressed weights.
EXACT_ATTACKS: list[tuple[str, Mutation, str]] = [
    ("buffer dtype", _set("averaged/float64", np.array([7], np.float32)), "expected float64"),
    ("buffer length", _set("averaged/float64", np.array([7.0, 8.0])), "expected \\(1,\\)"),
    ("buffer missing", _drop("averaged/float64"), "missing arrays: averaged/float64"),
    ("buffer NaN", _set("averaged/float64", np.array([np.nan])), "contains NaN"),
    ("buffer overflow", _set("averaged/float64", np.array([1e30])), "outside the range of int64"),
    ("buffer extra", _set("averaged/float32", np.ones(1, np.float32)), "unexpected arrays"),
]
IDENTITY_ATTACKS: list[tuple[str, Mutation, str]] = [
    ("NaN", _edit("raw.w", _index(0, np.nan)), "'raw.w' contains NaN"),  # type: ignore[arg-type]
    ("shape", _set("raw.w", np.zeros((4, 3), np.float32)), "shape \\(4, 3\\)"),
    ("dtype", _set("raw.w", np.zeros((3, 4), np.float64)), "dtype float64, expected float32"),
    ("missing", _drop("raw.w"), "missing arrays: raw.w"),
    ("extra", _set("raw.x", np.zeros(1, np.float32)), "unexpected arrays: raw.x"),
]


@pytest.mark.parametrize(
    ("codec", "attack", "match"),
    [pytest.param(TopK(k=3), m, r, id=f"topk-{n}") for n, m, r in TOPK_ATTACKS + EXACT_ATTACKS]
    + [
        pytest.param(StochasticInt8(), m, r, id=f"int8-{n}")
        for n, m, r in INT8_ATTACKS + EXACT_ATTACKS
    ]
    + [
        pytest.param(StochasticInt4(), m, r, id=f"int4-{n}")
        for n, m, r in INT4_ATTACKS + EXACT_ATTACKS
    ]
    + [pytest.param(Identity(), m, r, id=f"none-{n}") for n, m, r in IDENTITY_ATTACKS],
)
def test_decode_rejects_hostile_wire(codec: Codec, attack: Mutation, match: str) -> None:
    wire: dict[str, object] = dict(codec.encode(MODEL, rng=rng()))
    codec.decode(wire, LAYOUT)  # type: ignore[arg-type]  # the honest wire decodes
    attack(wire)
    with pytest.raises(UpdateRejected, match=match):
        codec.decode(wire, LAYOUT)  # type: ignore[arg-type]


ODD: Arrays = {"v": np.linspace(-1, 1, 77, dtype=np.float32)}  # two blocks, a padded byte


def _last_high_nibble(value: int) -> Callable[[np.ndarray], None]:
    def fn(a: np.ndarray) -> None:
        a[-1] = (a[-1] & 0x0F) | (value << 4)

    return fn


@pytest.mark.parametrize(
    ("attack", "match"),
    [
        (_edit("int4.v", _last_high_nibble(9)), "pads its last byte with 9, not 8"),
        (_set("int4.v.scale", np.array([1.0, np.inf], np.float32)), "finite and >= 0"),
        (_set("int4.v.scale", np.ones(2)), "dtype float64, expected float32"),
        (_set("int4.v", np.full((39, 1), 0x88, np.uint8)), "expected \\(39,\\)"),
        (_edit("int4.v.scale", _index(1, 0)), "non-zero codes in a block of scale 0"),
    ],
    ids=["padding", "inf scale", "float64 scales", "2-D codes", "second block zero"],
)
def test_int4_decode_rejects_hostile_wire_of_an_odd_length_array(
    attack: Mutation, match: str
) -> None:
    wire: dict[str, object] = dict(StochasticInt4().encode(ODD, rng=rng()))
    StochasticInt4().decode(wire, Layout.of(ODD))  # type: ignore[arg-type]
    attack(wire)
    with pytest.raises(UpdateRejected, match=match):
        StochasticInt4().decode(wire, Layout.of(ODD))  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", [StochasticInt8(), StochasticInt4()], ids=["int8", "int4"])
def test_a_scale_past_a_float16_models_range_is_refused_not_decoded_to_inf(codec: Codec) -> None:
    model: Arrays = {"h": np.array([0.5, -1.0, 0.25], np.float16)}
    wire = dict(codec.encode(model, rng=rng()))
    scale = f"{codec.name}.h.scale"
    wire[scale] = np.full_like(wire[scale], 1e30)  # a float32 the float16 result cannot hold
    with pytest.raises(UpdateRejected, match="decodes beyond the range of float16"):
        codec.decode(wire, Layout.of(model))


# ---------------------------------------------------------------- make_codec
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", Identity()),
        ("int8", StochasticInt8()),
        (" INT8 ", StochasticInt8()),
        ("int4", StochasticInt4()),
        ("topk:0.01", TopK(fraction=0.01)),
        ("topk:1.0", TopK(fraction=1.0)),
        ("topk:1e-3", TopK(fraction=0.001)),
        ("topk:5000", TopK(k=5000)),
        ("topk: 7", TopK(k=7)),
    ],
)
def test_make_codec_parses(spec: str, expected: Codec) -> None:
    codec = make_codec(spec)
    assert codec == expected
    assert make_codec(codec.name) == codec  # a codec's name is its spec


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "unknown codec ''; allowed: 'none', 'int8', 'int4', 'topk:<k>'"),
        ("int2", "unknown codec 'int2'"),
        ("topk", "unknown codec 'topk'"),
        ("topk:", "needs a count or a fraction"),
        ("topk:abc", "needs a count or a fraction"),
        ("topk:nan", "needs a count or a fraction"),
        ("topk:1e400", "needs a count or a fraction"),
        ("topk:0", "k must be an integer >= 1, got 0"),
        ("topk:-3", "k must be an integer >= 1, got -3"),
        ("topk:1.5", "fraction must be in \\(0, 1\\], got 1.5"),
        ("topk:0.0", "fraction must be in \\(0, 1\\], got 0.0"),
    ],
)
def test_make_codec_rejects_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_codec(spec)


# ------------------------------------------------- the flat error-feedback path
def generic_compress(
    residual: Arrays, update: Arrays, codec: Codec, generator: np.random.Generator
) -> tuple[Wire, Arrays, Arrays]:
    """The reference: v = u + e, then codec.encode(unflatten(v)), decode, e = v − ŝ."""
    layout = Layout.of(update)
    v = layout.flatten(update)
    if residual:
        v += layout.flatten(residual)
    wire = codec.encode(layout.unflatten(v), rng=generator)
    sent = codec.decode(wire, layout)
    return wire, sent, layout._split(v - layout.flatten(sent))


MIXED_DTYPES = st.sampled_from([np.float32, np.float32, np.float16, np.float64, np.int64, np.bool_])


@st.composite
def mixed_sequences(draw: st.DrawFn) -> list[Arrays]:
    shapes = draw(layouts(buffer=draw(st.booleans())))
    dtypes = {n: np.dtype(draw(MIXED_DTYPES)) for n in shapes}
    dtypes.update({n: np.dtype(np.int64) for n in shapes if n.endswith("num_batches_tracked")})

    def one() -> Arrays:
        out: Arrays = {}
        for name, shape in shapes.items():
            dtype = dtypes[name]
            if dtype.kind == "f":
                values = draw(hnp.arrays(np.float32, shape, elements=ELEMENTS))
                with np.errstate(over="ignore"):  # float16's overflow to inf is a case too
                    out[name] = values.astype(dtype)
            elif dtype.kind == "b":
                out[name] = draw(hnp.arrays(np.bool_, shape))
            else:
                out[name] = draw(hnp.arrays(dtype, shape, elements=st.integers(-(2**26), 2**26)))
        return out

    return [one() for _ in range(draw(st.integers(1, 4)))]


@settings(max_examples=150, deadline=None)
@given(
    sequence=mixed_sequences(),
    codec=st.one_of(top_ks(), st.just(StochasticInt8()), st.just(StochasticInt4())),
    seed=st.integers(0, 2**32),
)
def test_error_feedback_is_the_generic_encode_decode_to_the_bit(
    sequence: list[Arrays], codec: Codec, seed: int
) -> None:
    feedback, generator, reference = ErrorFeedback(), rng(seed), rng(seed)
    residual: Arrays = {}
    for update in sequence:
        try:
            expected = generic_compress(residual, update, codec, reference)
        except (ValueError, ConfigError) as exc:
            with pytest.raises(type(exc)):
                feedback.compress(update, codec, rng=generator)
            return
        wire, sent = feedback.compress(update, codec, rng=generator)
        want_wire, want_sent, residual = expected
        assert list(wire) == list(want_wire)
        for key, value in want_wire.items():
            assert wire[key].dtype == value.dtype
            np.testing.assert_array_equal(wire[key], value)
        assert sent is not None
        for name, value in want_sent.items():
            assert sent[name].dtype == value.dtype
            np.testing.assert_array_equal(sent[name], value)
        for name, value in residual.items():
            np.testing.assert_array_equal(feedback.residual[name], value)


def test_error_feedback_without_the_dense_sent_keeps_the_same_residual() -> None:
    update: Arrays = {"w": rng(1).standard_normal(300).astype(np.float32)}
    with_sent, without = ErrorFeedback(), ErrorFeedback()
    for seed in range(3):
        wire_a, sent = with_sent.compress(update, TopK(k=9), rng=rng(seed))
        wire_b, none = without.compress(update, TopK(k=9), rng=rng(seed), dense=False)
        assert sent is not None and none is None
        np.testing.assert_array_equal(wire_a[TOPK_VALUES], wire_b[TOPK_VALUES])
        np.testing.assert_array_equal(with_sent.residual["w"], without.residual["w"])


def test_error_feedback_reads_a_read_only_residual_without_writing_it() -> None:
    kept = np.full(4, 0.25)
    kept.flags.writeable = False
    feedback = ErrorFeedback(residual={"w": kept})
    feedback.compress({"w": np.ones(4, np.float32)}, TopK(k=1), rng=rng())
    np.testing.assert_array_equal(kept, np.full(4, 0.25))
    np.testing.assert_array_equal(feedback.residual["w"], [0.0, 1.25, 1.25, 1.25])


# ------------------------------------------------- differences without float64 copies
@settings(max_examples=150, deadline=None)
@given(sequence=mixed_sequences())
def test_differences_are_the_float64_difference_rounded(sequence: list[Arrays]) -> None:
    start, trained = sequence[0], sequence[-1]
    layout = Layout.of(start)
    got = difference(trained, start)
    assert list(got) == list(start)
    for name, before in start.items():
        if before.dtype.kind == "b":
            continue  # bool minus bool: float64 route, tested by the sites' tests
        with np.errstate(invalid="ignore", over="ignore"):  # inf − inf is NaN on both sides
            want = (trained[name].astype(np.float64) - before).astype(before.dtype)
        assert isinstance(got[name], np.ndarray) and got[name].dtype == before.dtype
        np.testing.assert_array_equal(got[name], want)
    with np.errstate(invalid="ignore", over="ignore"):
        want_flat = (layout.flatten(trained) - layout.flatten(start)).astype(np.float32)
    np.testing.assert_array_equal(layout.flat_difference(trained, start), want_flat)


@settings(max_examples=100, deadline=None)
@given(sequence=mixed_sequences(), data=st.data())
def test_assign_is_set_values_in_the_flat_float64_model(sequence: list[Arrays], data) -> None:
    model = sequence[0]
    layout = Layout.of(model)
    count = data.draw(st.integers(0, layout.size))
    indices = np.array(
        data.draw(st.lists(st.integers(0, layout.size - 1), min_size=count, max_size=count)),
        dtype=np.int64,
    )
    values = np.array(
        data.draw(st.lists(st.integers(-1000, 1000), min_size=count, max_size=count)),
        dtype=np.float32,
    ) / np.float32(8)
    flat64 = layout.flatten(model)
    flat64[indices] = values  # numpy: a repeated index keeps its last value
    want = layout.unflatten(flat64)
    got = layout.assign(model, indices, values)
    for name in model:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])


def test_assign_sorts_unsigned_indices_too() -> None:
    model = {"w": np.zeros(10, np.float32)}
    indices = np.array([9, 0, 7, 4], dtype=np.uint32)  # np.diff would wrap, not go negative
    values = np.array([1, 2, 3, 4], dtype=np.float32)
    got = Layout.of(model).assign(model, indices, values)
    np.testing.assert_array_equal(got["w"], [2, 0, 0, 0, 4, 0, 0, 3, 0, 1])


def test_a_float32_residual_is_added_in_float64() -> None:
    residual = {"w": np.array([1.0000000009313226, 0.0], np.float64).astype(np.float32)}
    u = {"w": np.array([np.float32(1e-9), 0.0], np.float32)}
    feedback = ErrorFeedback(residual=dict(residual))
    _, sent = feedback.compress(u, TopK(k=2), rng=rng())
    want = np.float64(residual["w"][0]) + np.float64(u["w"][0])
    assert feedback.residual["w"][0] + float(sent["w"][0]) == want


def test_int8_reports_the_problems_in_the_generic_order() -> None:
    # an integer array out of range and NaN in a float array: the range is said first
    update = {"a": np.array([np.nan], np.float32), "z": np.array([1], np.int8)}
    feedback = ErrorFeedback(residual={"a": np.zeros(1), "z": np.array([1e6])})
    with pytest.raises(ValueError, match="outside the range"):
        feedback.compress(update, StochasticInt8(), rng=rng())


# Twenty-one 4-value arrays: int8 sends each as codes and a scale, two framed arrays for
# one; top-k sends two arrays in all.
TINY = {"w": np.zeros(4, np.float32)} | {
    f"layer{i}.bias": np.zeros(4, np.float32) for i in range(20)
}


def test_a_codec_that_would_enlarge_the_upload_says_so() -> None:
    said = codec_enlarges(make_codec("int8"), arrays_to_record(TINY))
    assert said is not None
    assert said.startswith("codec int8 uploads ") and "(84 values in 21 arrays)" in said
    assert "codec none sends less" in said
    assert codec_enlarges(make_codec("topk:0.5"), arrays_to_record(TINY)) is None
    assert codec_enlarges(make_codec("none"), arrays_to_record(TINY)) is None
    one_array = arrays_to_record({"w": np.zeros(10_000, np.float32)})
    assert codec_enlarges(make_codec("int8"), one_array) is None


def plain_site(msg: Message, sent: np.ndarray) -> RecordDict:
    """A site without the codec mod: its model back, whole."""
    metrics = MetricRecord({keys.NUM_EXAMPLES: 1})
    return RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS], keys.METRICS: metrics})


@pytest.mark.usefixtures("task_identity")
def test_a_run_whose_codec_enlarges_the_upload_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = ScriptedGrid({1: replying_site("a", plain_site), 2: replying_site("b", plain_site)})
    with caplog.at_level("WARNING", logger="flplatform.strategies.local_sgd"):
        start(
            LocalSGDAveraging(codec="int8"),
            grid,
            arrays_to_record(TINY),
            num_rounds=3,
            reject_replays=False,
        )
    assert sum("codec int8 uploads" in r.message for r in caplog.records) == 1
