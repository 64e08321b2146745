"""The site halves' memory-speed paths against their naive float64 definitions, to the bit.

``SitePeriods`` keeps its periods in the model's dtypes and sums them block by block;
``SiteAccumulators.stepped`` writes new u and v from read-only stored ones; the mods keep
malloc's freed blocks for reuse. Each is checked against the plain computation it replaces.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strategies.compensation import SUM_BLOCK, SitePeriods, sum_in_float64
from strategies.mods.contract import _reuse_freed_memory, reuse_freed_memory
from strategies.sketch_feedback import SiteAccumulators

FLOATS = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


def naive_local_model(
    global_model: dict[str, np.ndarray], periods: SitePeriods
) -> dict[str, np.ndarray]:
    """x_v + Σ pending + carry in whole float64 arrays, then rounded: the definition."""
    out = {}
    for name, value in global_model.items():
        total = value.astype(np.float64)
        for update in [*periods.pending.values(), *([periods.carry] if periods.carry else [])]:
            total = total + np.asarray(update[name], dtype=np.float64)
        out[name] = total.astype(value.dtype)
    return out


@settings(max_examples=80, deadline=None)
@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=6),
    pending=st.integers(0, 3),
    carry=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float16, np.int64]),
    data=st.data(),
)
def test_the_local_model_is_the_float64_sum_rounded_once(
    shape: tuple[int, ...], pending: int, carry: bool, dtype: type, data: st.DataObject
) -> None:
    def draw(kind: type) -> np.ndarray:
        return data.draw(hnp.arrays(np.float32, shape, elements=FLOATS)).astype(kind)

    global_model = {"w": draw(dtype)}
    periods = SitePeriods(
        pending={p: {"w": draw(dtype)} for p in range(1, pending + 1)},
        carry={"w": draw(np.float64)} if carry else None,
    )
    got = periods.local_model(global_model, compensate=True)
    want = naive_local_model(global_model, periods)
    assert got["w"].dtype == want["w"].dtype
    np.testing.assert_array_equal(got["w"], want["w"])


def test_the_blocked_sum_is_the_whole_array_sum_across_blocks() -> None:
    generator = np.random.default_rng(0)
    n = 2 * SUM_BLOCK + 17  # three blocks, the last a short one
    terms = [generator.standard_normal(n).astype(np.float32) for _ in range(3)]
    terms.append(generator.standard_normal(n) * 1e-3)  # a float64 carry
    want = (terms[0].astype(np.float64) - terms[1] + terms[2] + terms[3]).astype(np.float32)
    got = sum_in_float64(terms, np.dtype(np.float32), signs=(1, -1, 1, 1))
    np.testing.assert_array_equal(got, want)


def test_a_recorded_period_is_kept_in_the_models_dtype_with_the_values_sent() -> None:
    start = {"w": np.array([1.0, 2.0, 3.0], np.float32), "n": np.array(4, np.int64)}
    trained = {"w": np.array([1.5, 1.0, 3.25], np.float32), "n": np.array(6, np.int64)}
    periods = SitePeriods(carry={"w": np.array([0.1, 0.0, 0.0]), "n": np.array(1.0)})
    sent = periods.record(3, start, trained, compensate=True)
    # the carry joins this update in float64, then one rounding to float32
    np.testing.assert_array_equal(sent["w"], np.float32([0.5 + 0.1, -1.0, 0.25]))
    assert sent["n"] == 3 and sent["n"].dtype == np.int64
    assert periods.carry is None and periods.pending[3] is sent
    # without a carry: trained − start in float32 is the float64 difference rounded
    sent = periods.record(4, start, trained, compensate=True)
    np.testing.assert_array_equal(sent["w"], [0.5, -1.0, 0.25])


@settings(max_examples=80, deadline=None)
@given(
    d=st.integers(1, 40),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    seed=st.integers(0, 2**32 - 1),
    zero_count=st.integers(0, 5),
)
def test_stepped_accumulators_are_zero_then_add_on_copies(
    d: int, momentum: float, seed: int, zero_count: int
) -> None:
    generator = np.random.default_rng(seed)
    u = generator.standard_normal(d).astype(np.float32)
    v = generator.standard_normal(d).astype(np.float32)
    g = generator.standard_normal(d).astype(np.float32)
    g[generator.random(d) < 0.2] = -0.0  # signed zeros must come out as zero() + add() gives
    zero = torch.from_numpy(generator.choice(d, min(d, zero_count), replace=False))
    u.flags.writeable = v.flags.writeable = False
    reference = SiteAccumulators(momentum, torch.tensor(u), torch.tensor(v))
    reference.zero(zero)
    reference.add(torch.from_numpy(g))
    stored = SiteAccumulators(momentum, torch.tensor(u), torch.tensor(v))
    before_u, before_v = stored.u.clone(), stored.v.clone()
    got = stored.stepped(torch.from_numpy(g), zero)
    assert got.u.numpy().tobytes() == reference.u.numpy().tobytes()
    assert got.v.numpy().tobytes() == reference.v.numpy().tobytes()
    assert torch.equal(stored.u, before_u) and torch.equal(stored.v, before_v)  # only read


def test_freed_memory_reuse_can_be_turned_off(monkeypatch) -> None:
    assert _reuse_freed_memory(False) is False
    monkeypatch.setenv("FLPLATFORM_REUSE_FREED_MEMORY", "0")
    assert reuse_freed_memory() is False
    monkeypatch.setenv("FLPLATFORM_REUSE_FREED_MEMORY", "1")
    # glibc's Linux (this project's machines) accepts both settings
    assert reuse_freed_memory() is True


def test_a_bool_or_unsigned_decrease_is_sent_as_no_change_not_wrapped() -> None:
    """Deltas travel in the model's dtypes: a uint8 counter 5 -> 3 was sent as 254 (the
    server then refused the step, or averaged two sites' 3 and 7 to 133) and a bit turned
    off as True (turning it on). Such arrays can only grow (strategies.mods says so)."""
    from strategies.layout import difference

    start = {
        "count": np.array([5, 5, 0], np.uint8),
        "mask": np.array([True, False, True]),
        "steps": np.array([5, 5], np.int64),
    }
    trained = {
        "count": np.array([3, 7, 255], np.uint8),
        "mask": np.array([False, True, True]),
        "steps": np.array([3, 7], np.int64),
    }
    sent = difference(trained, start)
    np.testing.assert_array_equal(sent["count"], np.array([0, 2, 255], np.uint8))
    np.testing.assert_array_equal(sent["mask"], [False, True, False])
    np.testing.assert_array_equal(sent["steps"], [-2, 2])  # signed: exact
    kept = sum_in_float64(
        [trained["count"], start["count"], np.array([1, 0, 0], np.float64)],
        np.dtype(np.uint8),
        signs=(1, -1, 1),
    )  # with a carry (compensation), the same rule
    np.testing.assert_array_equal(kept, np.array([0, 2, 255], np.uint8))
