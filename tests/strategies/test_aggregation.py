"""Weighted averaging against a NumPy oracle, Hypothesis properties and a golden case."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.core.errors import StepRefused
from strategies.aggregation import (
    BLOCK,
    ServerOptimizerState,
    WeightedDeltaSum,
    add_scaled,
    apply_server_update,
    float64_model,
    model_delta,
    weighted_average,
)


def oracle_fedavg(
    models: list[dict[str, np.ndarray]], weights: list[float]
) -> dict[str, np.ndarray]:
    """Naive Σ w x / Σ w, one array at a time, in float64."""
    total = float(sum(weights))
    return {
        key: sum(w * m[key].astype(np.float64) for m, w in zip(models, weights, strict=True))
        / total
        for key in models[0]
    }


def random_models(rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    return [
        {
            "w": rng.normal(size=(3, 4)).astype(np.float32),
            "b": rng.normal(size=(4,)).astype(np.float32),
        }
        for _ in range(n)
    ]


def streamed(base, models, weights, *, eta=1.0, beta=0.0, state=None):
    acc = WeightedDeltaSum()
    for model, weight in zip(models, weights, strict=True):
        acc.add({k: model[k].astype(np.float64) - base[k] for k in base}, weight)
    return apply_server_update(
        base, acc.mean(), eta=eta, beta=beta, state=state or ServerOptimizerState()
    )


def test_golden_two_sites_by_hand() -> None:
    # x = 0; site A sends 1.0 with 1 example, site B sends 4.0 with 3 examples:
    # (1·1 + 3·4) / 4 = 3.25.
    base = {"p": np.array([0.0], dtype=np.float32)}
    out = streamed(
        base, [{"p": np.array([1.0], np.float32)}, {"p": np.array([4.0], np.float32)}], [1, 3]
    )
    assert out["p"].dtype == np.float32
    assert out["p"][0] == pytest.approx(3.25)


def test_golden_server_momentum_by_hand() -> None:
    # FedAvgM, η = 0.5, β = 0.9, the same mean delta 2.0 twice:
    # v1 = 2, x1 = 0 + 0.5·2 = 1; v2 = 0.9·2 + 2 = 3.8, x2 = 1 + 0.5·3.8 = 2.9.
    state = ServerOptimizerState()
    x0 = {"p": np.array([0.0], np.float32)}
    x1 = apply_server_update(x0, {"p": np.array([2.0])}, eta=0.5, beta=0.9, state=state)
    x2 = apply_server_update(x1, {"p": np.array([2.0])}, eta=0.5, beta=0.9, state=state)
    assert x1["p"][0] == pytest.approx(1.0)
    assert x2["p"][0] == pytest.approx(2.9)


def test_golden_nesterov_momentum_by_hand() -> None:
    # DiLoCo's outer step, η = 0.5, β = 0.9, the same mean delta 2.0 twice: v1 = 2,
    # x1 = 0 + 0.5·(2 + 0.9·2) = 1.9; v2 = 0.9·2 + 2 = 3.8, x2 = 1.9 + 0.5·(2 + 0.9·3.8) = 4.61.
    state = ServerOptimizerState()
    x0 = {"p": np.array([0.0], np.float32)}
    step = {"p": np.array([2.0])}
    x1 = apply_server_update(x0, step, eta=0.5, beta=0.9, nesterov=True, state=state)
    assert step["p"].tolist() == [2.0]  # not spent: the caller's mean is left alone
    x2 = apply_server_update(x1, step, eta=0.5, beta=0.9, nesterov=True, state=state)
    assert x1["p"][0] == pytest.approx(1.9)
    assert x2["p"][0] == pytest.approx(4.61)
    assert state.velocity["p"].tolist() == [pytest.approx(3.8)]


@settings(max_examples=40, deadline=None)
@given(
    eta=st.sampled_from([1.0, 0.7, 0.1]),
    beta=st.sampled_from([0.5, 0.9]),
    nesterov=st.booleans(),
    rounds=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_the_server_step_is_torch_sgd_given_the_outer_gradient(
    eta: float, beta: float, nesterov: bool, rounds: int, seed: int
) -> None:
    """PyTorch's SGD with momentum (heavy ball or Nesterov) on the "outer gradient" −Δ̄ is
    the naive reference (DiLoCo's outer optimizer is exactly that)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    x = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=4)}
    reference = {k: torch.tensor(v, requires_grad=True) for k, v in x.items()}
    optimizer = torch.optim.SGD(reference.values(), lr=eta, momentum=beta, nesterov=nesterov)
    state = ServerOptimizerState()
    for _ in range(rounds):
        mean = {k: rng.normal(size=np.shape(v)) for k, v in x.items()}
        for key, tensor in reference.items():
            tensor.grad = torch.tensor(-mean[key])
        optimizer.step()
        spent = bool(rng.integers(2))
        x = apply_server_update(
            x, mean, eta=eta, beta=beta, nesterov=nesterov, state=state, spent=spent
        )
    for key, tensor in reference.items():
        np.testing.assert_allclose(x[key], tensor.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_golden_delayed_nesterov_by_hand() -> None:
    # N = 2, β = 0.5, η = 1, mean deltas 2, 4, 2, 0 from x = 0:
    # step 1: P = 2, x = 2/2 = 1; step 2: P = 6, v = 6/2 = 3, x = 1 + (4/2 + 0.5·3) = 4.5;
    # step 3: P = 2, x = 4.5 + 2/2 = 5.5; step 4: P = 2, v = 0.5·3 + 2/2 = 2.5,
    # x = 5.5 + (0/2 + 0.5·2.5) = 6.75.
    state = ServerOptimizerState()
    x = {"p": np.array([0.0])}
    seen = []
    for delta in (2.0, 4.0, 2.0, 0.0):
        x = apply_server_update(
            x,
            {"p": np.array([delta])},
            eta=1.0,
            beta=0.5,
            nesterov=True,
            momentum_every=2,
            state=state,
        )
        seen.append(float(x["p"][0]))
    assert seen == pytest.approx([1.0, 4.5, 5.5, 6.75])
    assert state.velocity["p"].tolist() == [pytest.approx(2.5)] and state.steps == 4
    assert state.pending["p"].tolist() == [0.0]
    with pytest.raises(ValueError, match="momentum_every"):
        apply_server_update(x, x, eta=1.0, beta=0.5, momentum_every=2, state=state)


def naive_delayed_nesterov(
    x: dict[str, np.ndarray], means: list[dict[str, np.ndarray]], eta: float, beta: float, n: int
) -> dict[str, np.ndarray]:
    """Liu et al.'s delayed Nesterov (c = 0) written out plainly, array by array."""
    out = {}
    for key, start in x.items():
        value, velocity, pending = start.astype(np.float64), np.zeros(start.shape), 0.0
        for t, mean in enumerate(means, start=1):
            pending = pending + mean[key]
            if t % n == 0:
                velocity = beta * velocity + pending / n
                pending = 0.0
                value = value + eta * (mean[key] / n + beta * velocity)
            else:
                value = value + eta * mean[key] / n
        out[key] = value
    return out


@settings(max_examples=40, deadline=None)
@given(
    eta=st.sampled_from([1.0, 0.7]),
    beta=st.sampled_from([0.5, 0.9]),
    every=st.integers(1, 4),
    steps=st.integers(1, 9),
    seed=st.integers(0, 2**31),
)
def test_delayed_nesterov_matches_the_naive_rule_and_is_nesterov_at_one(
    eta: float, beta: float, every: int, steps: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x0 = {"w": rng.normal(size=(2, 3)), "b": rng.normal(size=2)}
    means = [{k: rng.normal(size=v.shape) for k, v in x0.items()} for _ in range(steps)]
    # N = 1 in the naive rule is Nesterov's step (v ← βv + Δ̄, x ← x + η(Δ̄ + βv))
    for n in {every, 1}:
        state, x = ServerOptimizerState(), x0
        for mean in means:
            spent = bool(rng.integers(2))
            given = {k: v.copy() for k, v in mean.items()}
            x = apply_server_update(
                x,
                given,
                eta=eta,
                beta=beta,
                nesterov=True,
                momentum_every=n,
                state=state,
                spent=spent,
            )
        expected = naive_delayed_nesterov(x0, means, eta, beta, n)
        for key in x0:
            np.testing.assert_allclose(x[key], expected[key], rtol=1e-10, atol=1e-10)


def test_golden_averaged_arrays_take_the_sites_mean_without_momentum_or_rate() -> None:
    # FedAvgM, η = 0.5, β = 0.9: "p" as in the test above. A running variance at 1.0
    # whose sites' mean is 0.2, then 0.1 (Δ̄ = -0.8, then -0.1) becomes exactly that,
    # 0.2 then 0.1; momentum would make it 1 + 0.5·(-0.8) = 0.6, then
    # 0.6 + 0.5·(0.9·(-0.8) - 0.1) = 0.19, and with η = 1, 0.2 then -0.62.
    state = ServerOptimizerState()
    x0 = {"p": np.array([0.0], np.float32), "bn.running_var": np.array([1.0], np.float32)}
    names = ("bn.running_var",)
    step1 = {"p": np.array([2.0]), "bn.running_var": np.array([-0.8])}
    x1 = apply_server_update(x0, step1, eta=0.5, beta=0.9, state=state, averaged=names)
    step2 = {"p": np.array([2.0]), "bn.running_var": np.array([-0.1])}
    x2 = apply_server_update(x1, step2, eta=0.5, beta=0.9, state=state, averaged=names)
    assert x1["p"][0] == pytest.approx(1.0) and x2["p"][0] == pytest.approx(2.9)
    assert x1["bn.running_var"][0] == pytest.approx(0.2)
    assert x2["bn.running_var"][0] == pytest.approx(0.1)
    assert state.velocity["bn.running_var"].tolist() == [0.0]  # shapes kept for checkpoints


@settings(max_examples=40, deadline=None)
@given(
    eta=st.sampled_from([1.0, 0.5, 1.7]),
    beta=st.sampled_from([0.0, 0.9]),
    spent=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_averaged_arrays_are_x_plus_the_mean_delta_whatever_the_rest_does(
    eta: float, beta: float, spent: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = {
        "w": rng.normal(size=(3, 2)).astype(np.float32),
        "stats": rng.uniform(0.1, 2, size=4).astype(np.float32),
        "count": np.array(7, np.int64),
    }
    mean = {k: rng.normal(size=np.shape(v)) for k, v in x.items()}
    velocity = {k: rng.normal(size=np.shape(v)) for k, v in x.items()}
    state = ServerOptimizerState(velocity={k: v.copy() for k, v in velocity.items()})
    step = {k: v.copy() for k, v in mean.items()}
    out = apply_server_update(
        x, step, eta=eta, beta=beta, state=state, spent=spent, averaged=("stats", "count")
    )
    naive_w = x["w"].astype(np.float64) + eta * (
        beta * velocity["w"] + mean["w"] if beta else mean["w"]
    )
    assert out["w"].tobytes() == naive_w.astype(np.float32).tobytes()
    assert out["stats"].tobytes() == (x["stats"] + mean["stats"]).astype(np.float32).tobytes()
    assert out["count"] == np.rint(7 + mean["count"])
    if beta:
        assert not state.velocity["stats"].any() and not state.velocity["count"].any()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**31), data=st.data())
def test_matches_numpy_oracle(n: int, seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    models = random_models(rng, n)
    weights = data.draw(st.lists(st.integers(1, 10_000), min_size=n, max_size=n))
    base = random_models(rng, 1)[0]
    got = streamed(base, models, [float(w) for w in weights])
    want = oracle_fedavg(models, weights)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 6), seed=st.integers(0, 2**31), data=st.data())
def test_permutation_invariant(n: int, seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    models = random_models(rng, n)
    weights = [float(w) for w in data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))]
    order = data.draw(st.permutations(range(n)))
    base = models[0]
    a = streamed(base, models, weights)
    b = streamed(base, [models[i] for i in order], [weights[i] for i in order])
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**31), weight=st.integers(1, 10**6))
def test_identical_sites_give_that_model_back(n: int, seed: int, weight: int) -> None:
    rng = np.random.default_rng(seed)
    base, site = random_models(rng, 2)
    out = streamed(base, [site] * n, [float(weight)] * n)
    for key in site:
        np.testing.assert_allclose(out[key], site[key], rtol=0, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**31), scale=st.floats(1e-3, 1e3))
def test_scaling_all_weights_changes_nothing(n: int, seed: int, scale: float) -> None:
    rng = np.random.default_rng(seed)
    models = random_models(rng, n)
    weights = list(rng.integers(1, 100, size=n).astype(float))
    a = streamed(models[0], models, weights)
    b = streamed(models[0], models, [w * scale for w in weights])
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6)


def test_weighted_average_of_whole_models_matches_oracle() -> None:
    rng = np.random.default_rng(3)
    models = random_models(rng, 4)
    weights = [5.0, 1.0, 2.0, 8.0]
    got = weighted_average(models, weights)
    for key, value in oracle_fedavg(models, weights).items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-6)


def test_integer_buffers_are_rounded_not_truncated() -> None:
    base = {"count": np.array([10], dtype=np.int64)}
    out = streamed(base, [{"count": np.array([11])}, {"count": np.array([12])}], [1.0, 1.0])
    assert out["count"].dtype == np.int64
    assert out["count"][0] == 12  # 11.5 rounds half to even → 12


def test_a_bool_buffer_is_on_where_the_sites_mean_rounds_to_one() -> None:
    """astype(bool) turned every nonzero mean on: a bit 3 of 10 sites' examples set was
    set (FetchSGD, Sketched-SGD and the codecs round first: the same model now averages
    alike under every strategy)."""
    base = {"mask": np.array([True, True, False, False, False])}
    sites = [
        {"mask": np.array([True, False, True, False, True])},
        {"mask": np.array([False, False, False, False, True])},
    ]
    out = streamed(base, sites, [3.0, 7.0])  # means 0.3, 0, 0.3, 0, 1
    assert out["mask"].dtype == np.bool_
    np.testing.assert_array_equal(out["mask"], [False, False, False, False, True])


def test_zero_dimensional_arrays_are_summed_like_any_other() -> None:
    """A 0-d array (a BatchNorm counter) gets every site's update, not only the first's."""
    acc = WeightedDeltaSum()
    for value, weight in ((1.0, 1.0), (3.0, 1.0), (5.0, 2.0)):
        acc.add({"n": np.array(value)}, weight)
    assert acc.mean()["n"] == (1.0 + 3.0 + 2 * 5.0) / 4


def test_empty_sum_has_no_mean() -> None:
    with pytest.raises(ValueError):
        WeightedDeltaSum().mean()


# ------------------------------------------------- the per-update kernels, bit for bit
REAL_DTYPES = st.sampled_from([np.float32, np.float16, np.float64, np.int64, np.uint8, np.bool_])
SHAPES = st.sampled_from([(), (0,), (7,), (3, 5), (BLOCK + 3,), (2, BLOCK // 2 + 1)])


@settings(max_examples=60, deadline=None)
@given(
    dtype=REAL_DTYPES,
    shape=SHAPES,
    factor=st.floats(1e-6, 1e6),
    fortran=st.booleans(),
    spare=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_kernels_give_numpys_numbers_bit_for_bit(
    dtype: type, shape: tuple[int, ...], factor: float, fortran: bool, spare: bool, seed: int
) -> None:
    """model_delta and add_scaled, blocked or not, C or Fortran order, into fresh or spent
    memory, equal the plain expressions the server used to evaluate
    (``x.astype(float64) - base``, ``acc += np.multiply(delta, factor, dtype=float64)``)."""
    rng = np.random.default_rng(seed)

    def draw() -> np.ndarray:
        values = np.asarray(rng.normal(size=shape) * 100).astype(dtype)
        return np.asfortranarray(values) if fortran else values

    received, base = draw(), draw()
    expected = received.astype(np.float64) - base
    out = np.full(received.shape, np.nan) if spare else None
    for against in (base, float64_model({"x": base})["x"]):
        delta = model_delta(received, against, out=out)
        assert delta.dtype == np.float64 and delta.shape == expected.shape
        assert delta.tobytes() == expected.tobytes()
        assert out is None or delta is out
    acc = draw().astype(np.float64)
    reference = acc + np.multiply(expected, factor, dtype=np.float64)
    for spent in (False, True):
        into, value = acc.copy(), expected.copy()
        add_scaled(into, value, factor, spent=spent)
        assert into.tobytes() == reference.tobytes()
        assert spent or value.tobytes() == expected.tobytes()  # not spent: left as it was


def test_a_spent_sum_gives_the_same_mean_in_its_own_memory() -> None:
    rng = np.random.default_rng(3)
    acc = WeightedDeltaSum()
    for weight in (1.0, 2.5, 7.0):
        acc.add({"w": rng.normal(size=(3, 4)), "n": np.array(rng.normal())}, weight)
    fresh = acc.mean()
    sums = dict(acc.sums)
    spent = acc.mean(spent=True)
    for key in fresh:
        assert spent[key].tobytes() == fresh[key].tobytes()
        assert spent[key] is sums[key]


def test_a_complex_base_is_promoted_as_numpy_promotes_it() -> None:
    received = np.array([1.5, 2.5], np.float32)
    base = np.array([1 + 1j, 2 - 1j], np.complex64)
    np.testing.assert_array_equal(model_delta(received, base), received.astype(np.float64) - base)


def model_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A model array of ``dtype`` that the steps of these tests keep in its range (a step
    past an integer dtype's is refused)."""
    values = np.asarray(rng.normal(size=shape) * 10)
    if np.issubdtype(np.dtype(dtype), np.unsignedinteger):
        values = np.abs(values) + 20
    return values.astype(dtype)


@settings(max_examples=40, deadline=None)
@given(
    dtype=REAL_DTYPES,
    shape=SHAPES,
    eta=st.sampled_from([1.0, 0.5, 1.7]),
    beta=st.sampled_from([0.0, 0.9]),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_a_spent_mean_gives_the_same_step_bit_for_bit(
    dtype: type, shape: tuple[int, ...], eta: float, beta: float, nesterov: bool, seed: int
) -> None:
    nesterov = nesterov and beta > 0  # Nesterov needs a momentum to look ahead with
    rng = np.random.default_rng(seed)
    x = {"x": model_values(rng, shape, dtype)}
    mean = {"x": np.asarray(rng.normal(size=shape))}
    velocity = {"x": np.asarray(rng.normal(size=shape))}
    results = []
    for spent, x64 in ((False, None), (True, None), (True, float64_model(x))):
        state = ServerOptimizerState(velocity={k: v.copy() for k, v in velocity.items()})
        step = {k: v.copy() for k, v in mean.items()}
        out = apply_server_update(
            x, step, eta=eta, beta=beta, nesterov=nesterov, state=state, spent=spent, x64=x64
        )
        results.append((out["x"].dtype, out["x"].tobytes(), state.velocity["x"].tobytes()))
    v = beta * velocity["x"] + mean["x"]
    step_taken = (mean["x"] + beta * v if nesterov else v) if beta else mean["x"]
    plain = np.asarray(x["x"], dtype=np.float64) + eta * step_taken
    if np.issubdtype(np.dtype(dtype), np.integer):
        plain = np.rint(plain)
    elif np.dtype(dtype) == np.bool_:  # on where the value rounds to 1 (or more)
        plain = np.clip(np.rint(plain), 0, 1)
    assert results[0] == results[1] == results[2]
    assert results[0][1] == plain.astype(dtype).tobytes()


@settings(max_examples=40, deadline=None)
@given(dtype=REAL_DTYPES, shape=SHAPES, due=st.booleans(), seed=st.integers(0, 2**31))
def test_delayed_nesterov_with_a_spent_mean_gives_the_same_step_bit_for_bit(
    dtype: type, shape: tuple[int, ...], due: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = {"x": model_values(rng, shape, dtype)}
    mean = {"x": np.asarray(rng.normal(size=shape))}
    velocity, held = np.asarray(rng.normal(size=shape)), np.asarray(rng.normal(size=shape))
    results = []
    for spent, x64 in ((False, None), (True, None), (True, float64_model(x))):
        state = ServerOptimizerState({"x": velocity.copy()}, {"x": held.copy()}, int(due))
        step = {k: v.copy() for k, v in mean.items()}
        out = apply_server_update(
            x,
            step,
            eta=0.7,
            beta=0.9,
            nesterov=True,
            momentum_every=2,
            state=state,
            spent=spent,
            x64=x64,
        )
        saved = (state.velocity["x"].tobytes(), state.pending["x"].tobytes(), state.steps)
        results.append((out["x"].dtype, out["x"].tobytes(), saved))
    assert results[0] == results[1] == results[2]
    pending = held + mean["x"]
    v = 0.9 * velocity + pending / 2 if due else velocity
    plain = np.asarray(x["x"], dtype=np.float64) + 0.7 * (mean["x"] / 2 + (0.9 * v if due else 0))
    if np.issubdtype(np.dtype(dtype), np.integer):
        plain = np.rint(plain)
    elif np.dtype(dtype) == np.bool_:  # on where the value rounds to 1 (or more)
        plain = np.clip(np.rint(plain), 0, 1)
    assert results[0][1] == plain.astype(dtype).tobytes()
    left = np.zeros_like(pending) if due else pending
    assert results[0][2] == (v.tobytes(), left.tobytes(), 2 if due else 1)


def test_a_refused_delayed_nesterov_step_leaves_its_state_as_it_was() -> None:
    # The second array overflows float32: the first array's velocity, pending sum and the
    # step count must not move (the run goes on from the state it had).
    x = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    state = ServerOptimizerState({"a": np.ones(2), "b": np.ones(2)}, {"a": np.ones(2)}, 1)
    before = ({k: v.copy() for k, v in state.velocity.items()}, dict(state.pending), state.steps)
    mean = {"a": np.ones(2), "b": np.full(2, 1e39)}
    with pytest.raises(StepRefused, match="'b' would become non-finite"):
        apply_server_update(
            x, mean, eta=1.0, beta=0.9, nesterov=True, momentum_every=2, state=state
        )
    assert state.steps == before[2] and list(state.pending) == ["a"]
    assert state.pending["a"].tolist() == [1.0, 1.0]
    for key, value in before[0].items():
        assert state.velocity[key].tolist() == value.tolist()


def test_sums_and_the_float64_model_are_written_into_the_memory_given() -> None:
    rng = np.random.default_rng(4)
    memory = {"w": np.full((2, 3), np.nan), "n": np.zeros(5)}
    acc = WeightedDeltaSum(into=memory)
    delta = {"w": rng.normal(size=(2, 3)), "n": rng.normal(size=2)}
    acc.add(delta, 3.0)
    assert acc.sums["w"] is memory["w"] and acc.sums["n"] is not memory["n"]  # shape changed
    for key in delta:
        assert acc.sums[key].tobytes() == (np.asarray(delta[key], np.float64) * 3.0).tobytes()
    old = {"w": np.zeros((2, 3)), "n": np.zeros(1)}
    new = {
        "w": np.ones((2, 3), np.float32),
        "n": np.ones(2, np.int64),
        "c": np.ones(1, np.complex64),
    }
    cast = float64_model(new, into=old)
    assert cast["w"] is old["w"] and cast["n"] is not old["n"]
    assert cast["c"] is new["c"]  # complex: left for numpy's promotion
    for key in ("w", "n"):
        assert cast[key].dtype == np.float64
        np.testing.assert_array_equal(cast[key], new[key])


@pytest.mark.parametrize(
    ("dtype", "step"),
    [(np.int64, 1e30), (np.int64, 2.0**63), (np.int64, -(2.0**63) - 4096), (np.int32, 2.0**31)],
)
def test_an_integer_array_pushed_out_of_its_range_refuses_the_step(
    dtype: type, step: float
) -> None:
    """Found by a review: a step past an integer dtype's range was cast round it (1e30 and
    2^63 in int64 became -2^63, with only a RuntimeWarning); it is refused, the state as
    it was."""
    state = ServerOptimizerState()
    x = {"w": np.zeros(2, np.float32), "count": np.array([5], dtype)}
    with pytest.raises(StepRefused, match="'count' would leave"):
        apply_server_update(
            x, {"w": np.ones(2), "count": np.array([step])}, eta=1.0, beta=0.0, state=state
        )
    assert state.steps == 0
    # a step that still fits (exact in float64: beyond 2^53, x + η·step rounds)
    edge = float(np.iinfo(dtype).max) - 5 if dtype == np.int32 else 2.0**52
    fine = apply_server_update(
        x, {"w": np.ones(2), "count": np.array([edge])}, eta=1.0, beta=0.0, state=state
    )
    assert fine["count"].dtype == dtype and int(fine["count"][0]) == int(edge) + 5
