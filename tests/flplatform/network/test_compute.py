"""Compute-time models: each distribution's mean and shape, and the per-update scaling."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flplatform.core.errors import ConfigError
from flplatform.network import COMPUTE_MODELS, ComputeModel, compute_seconds

N = 20_000


def draws(model: ComputeModel, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([model.sample(rng) for _ in range(N)])


# ------------------------------------------------------------------------ distributions
def test_fixed_is_always_the_mean() -> None:
    assert set(draws(ComputeModel("fixed", 0.2)).tolist()) == {0.2}


def test_exponential_mean_and_tail() -> None:
    x = draws(ComputeModel("exponential", 0.05))
    assert x.mean() == pytest.approx(0.05, rel=0.03)
    # P(X > mean) = 1/e for an exponential, ~0.63 for a symmetric spread around the mean.
    assert (x > 0.05).mean() == pytest.approx(math.exp(-1), abs=0.015)
    assert x.min() >= 0.0


def test_shifted_exponential_never_below_the_shift_and_keeps_the_mean() -> None:
    x = draws(ComputeModel("shifted-exponential", mean_seconds=0.05, shift_seconds=0.03))
    assert x.min() >= 0.03
    assert x.mean() == pytest.approx(0.05, rel=0.03)
    # The part above the shift is exponential with mean 0.02: P(X - shift > 0.02) = 1/e.
    assert (x - 0.03 > 0.02).mean() == pytest.approx(math.exp(-1), abs=0.015)


@pytest.mark.parametrize("shape", [1.5, 2.5, 3.0, 6.0])
def test_pareto_minimum_mean_and_tail(shape: float) -> None:
    model = ComputeModel("pareto", mean_seconds=0.05, pareto_shape=shape)
    x_m = 0.05 * (shape - 1) / shape
    assert model.pareto_minimum_seconds == pytest.approx(x_m)
    x = draws(model)
    assert x.min() >= x_m
    # P(X > 2 x_m) = 2^-a for the classic Pareto.
    assert (x > 2 * x_m).mean() == pytest.approx(2.0**-shape, abs=0.015)
    if shape > 2:  # finite variance: the sample mean settles within a few %
        assert x.mean() == pytest.approx(0.05, rel=0.03)
    else:  # infinite variance: the median x_m 2^(1/a) is the stable check
        assert np.median(x) == pytest.approx(x_m * 2 ** (1 / shape), rel=0.03)


def test_measured_draws_nothing() -> None:
    model = ComputeModel("measured")
    rng = np.random.default_rng(1)
    assert model.sample(rng) is None
    assert model.expected() is None
    # The generator did not advance.
    assert rng.random() == np.random.default_rng(1).random()


@pytest.mark.parametrize("kind", [k for k in COMPUTE_MODELS if k != "measured"])
def test_expected_is_the_mean_for_every_drawn_model(kind: str) -> None:
    model = ComputeModel(kind, mean_seconds=0.3, shift_seconds=0.1)
    assert model.expected() == 0.3


def test_draws_are_reproducible_from_the_seed() -> None:
    model = ComputeModel("pareto")
    assert np.array_equal(draws(model, seed=5)[:50], draws(model, seed=5)[:50])
    assert not np.array_equal(draws(model, seed=5)[:50], draws(model, seed=6)[:50])


# ------------------------------------------------------------------------- validation
def test_default_model_is_valid() -> None:
    assert ComputeModel().problems() == []


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ComputeModel("gamma"), "model 'gamma' is unknown; allowed: fixed, exponential"),
        (ComputeModel(mean_seconds=0.0), "mean_seconds must be a finite number > 0, got 0"),
        (ComputeModel(mean_seconds=-1.0), "mean_seconds must be a finite number > 0, got -1"),
        (ComputeModel(mean_seconds=math.inf), "mean_seconds must be a finite number > 0"),
        (ComputeModel(mean_seconds=math.nan), "mean_seconds must be a finite number > 0"),
        (
            ComputeModel("shifted-exponential", mean_seconds=0.05, shift_seconds=0.05),
            r"shift_seconds must be < mean_seconds \(0.05\)",
        ),
        (
            ComputeModel("shifted-exponential", shift_seconds=-0.01),
            "shift_seconds must be a finite number >= 0, got -0.01",
        ),
        (ComputeModel("pareto", pareto_shape=1.0), "pareto_shape must be a finite number > 1"),
        (ComputeModel("pareto", pareto_shape=0.5), "pareto_shape must be a finite number > 1"),
    ],
)
def test_problems_name_the_field_and_what_is_allowed(model: ComputeModel, message: str) -> None:
    problems = model.problems()
    assert len(problems) == 1
    assert re.search(message, problems[0])
    with pytest.raises(ConfigError, match=message):
        model.sample(np.random.default_rng(0))


def test_every_problem_is_listed_at_once() -> None:
    model = ComputeModel("pareto", mean_seconds=-1.0, pareto_shape=1.0)
    assert [p.split()[0] for p in model.problems()] == ["mean_seconds", "pareto_shape"]


def test_shift_and_shape_are_checked_only_where_used() -> None:
    # A [defaults] shift larger than a site's own mean must not break an exponential site.
    assert ComputeModel("exponential", mean_seconds=0.01, shift_seconds=0.5).problems() == []
    assert ComputeModel("fixed", pareto_shape=0.5).problems() == []


def test_to_dict_uses_the_toml_keys() -> None:
    assert ComputeModel("pareto", 0.1, 0.0, 2.5).to_dict() == {
        "model": "pareto",
        "mean_seconds": 0.1,
        "shift_seconds": 0.0,
        "pareto_shape": 2.5,
    }


# ------------------------------------------------------------------- compute_seconds
def test_compute_seconds_fixed_golden() -> None:
    # 10 steps of 0.05 s on a site twice as fast: 0.25 s.
    rng = np.random.default_rng(0)
    t = compute_seconds(ComputeModel("fixed", 0.05), steps=10, speed=2.0, rng=rng, measured=None)
    assert t == pytest.approx(0.25)


def test_compute_seconds_measured_divides_by_speed_only() -> None:
    rng = np.random.default_rng(0)
    model = ComputeModel("measured")
    assert compute_seconds(model, steps=10, speed=0.5, rng=rng, measured=1.5) == 3.0
    assert compute_seconds(model, steps=10, speed=0.5, rng=rng, measured=None) is None


def test_compute_seconds_is_one_draw_scaled_by_steps() -> None:
    # One draw per update: the same generator state gives steps x the one-step draw.
    model = ComputeModel("exponential", 0.05)
    one = model.sample(np.random.default_rng(9))
    assert one is not None
    t = compute_seconds(model, steps=7, speed=1.0, rng=np.random.default_rng(9), measured=None)
    assert t == pytest.approx(7 * one)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": -1, "speed": 1.0, "measured": None}, "steps must be >= 0"),
        ({"steps": 1, "speed": 0.0, "measured": None}, "speed must be a finite number > 0"),
        ({"steps": 1, "speed": math.nan, "measured": None}, "speed must be a finite number > 0"),
    ],
)
def test_compute_seconds_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_seconds(ComputeModel(), rng=np.random.default_rng(0), **kwargs)


def test_compute_seconds_rejects_a_negative_measurement() -> None:
    with pytest.raises(ValueError, match="measured must be a finite number >= 0"):
        compute_seconds(
            ComputeModel("measured"),
            steps=1,
            speed=1.0,
            rng=np.random.default_rng(0),
            measured=-0.1,
        )


@given(
    kind=st.sampled_from(["fixed", "exponential", "shifted-exponential", "pareto"]),
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(0, 10_000),
    speed=st.floats(0.01, 100.0),
)
def test_compute_seconds_linear_in_steps_and_inverse_in_speed(
    kind: str, seed: int, steps: int, speed: float
) -> None:
    model = ComputeModel(kind, mean_seconds=0.05, shift_seconds=0.01, pareto_shape=2.5)
    base = compute_seconds(
        model, steps=1, speed=1.0, rng=np.random.default_rng(seed), measured=None
    )
    t = compute_seconds(
        model, steps=steps, speed=speed, rng=np.random.default_rng(seed), measured=None
    )
    assert base is not None and t is not None
    assert t == pytest.approx(steps * base / speed, rel=1e-12, abs=1e-300)
    assert t >= 0.0
