"""A site standardises its features with its own training statistics, and says their scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.scaling import feature_scale, standardize
from clients.site import load_site
from flplatform.core import keys
from flplatform.core.errors import ConfigError


def test_standardize_uses_the_training_statistics_alone_golden() -> None:
    # Per feature, over the two training examples: mean (1, 20, 7), std (1, 10, 0).
    train = np.array([[0.0, 10.0, 7.0], [2.0, 30.0, 7.0]], dtype=np.float32)
    val = np.array([[4.0, 0.0, 9.0]], dtype=np.float32)
    got_train, got_val = standardize(train, val)
    np.testing.assert_array_equal(got_train, [[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0]])
    # Held-out data is moved by the training statistics, not its own: (4-1)/1, (0-20)/10, and
    # the constant feature only centred (9-7), never divided by its zero spread.
    np.testing.assert_array_equal(got_val, [[3.0, -2.0, 2.0]])
    assert got_train.dtype == got_val.dtype == np.float32
    # The held-out values change nothing of the training side.
    again, _ = standardize(train, val * 100)
    np.testing.assert_array_equal(again, got_train)


def test_a_constant_feature_stays_finite_and_centred() -> None:
    # 0.1 is not exact in float32; a float32 mean would leave rounding noise to divide by.
    train = np.full((1001, 1, 2, 2), 0.1, dtype=np.float32)
    train[:, 0, 0, 0] = np.arange(1001)
    (out,) = standardize(train)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:, 0, 1:, :], 0.0)
    np.testing.assert_array_equal(out[:, 0, 0, 1], 0.0)
    assert out[:, 0, 0, 0].mean() == pytest.approx(0.0, abs=1e-6)
    assert out[:, 0, 0, 0].std() == pytest.approx(1.0, rel=1e-6)
    # Empty held-out data (a site too small for a validation slice) is fine.
    _, empty = standardize(train, train[:0])
    assert empty.shape == (0, 1, 2, 2)


def test_feature_scale_is_the_largest_per_feature_rms() -> None:
    # RMS per feature: sqrt((9 + 16) / 2), sqrt((0 + 4) / 2); offsets count as scale too.
    x = np.array([[3.0, 0.0], [4.0, 2.0]], dtype=np.float32)
    assert feature_scale(x) == pytest.approx(np.sqrt(12.5))
    assert feature_scale(np.full((3, 1), 2024.0)) == pytest.approx(2024.0)
    assert feature_scale(x[:0]) == 0.0


def write_site(path: Path, offset: float, spread: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = offset + spread * rng.standard_normal((40, 3))
    x[:, 2] = offset  # a column constant at this site
    np.savez(path, x=x, y=rng.integers(0, 2, 40))


def test_each_site_standardises_with_its_own_training_split(tmp_path: Path) -> None:
    sites = {"near": (0.0, 1.0), "far": (500.0, 80.0)}
    for index, (name, (offset, spread)) in enumerate(sites.items()):
        write_site(tmp_path / f"{name}.npz", offset, spread, seed=index)
    for name in sites:
        node = {keys.DATA_PATH: str(tmp_path / f"{name}.npz"), keys.SITE_NAME: name}
        raw = load_site(node, {"seed": 3})
        done = load_site(node, {"seed": 3, "standardize-features": True})
        # The same split into training and validation examples, then the site's own moments.
        mean = raw.x_train.astype(np.float64).mean(axis=0)
        std = raw.x_train.astype(np.float64).std(axis=0)
        std[std == 0] = 1.0
        np.testing.assert_allclose(done.x_train, (raw.x_train - mean) / std, atol=1e-5)
        np.testing.assert_allclose(done.x_val, (raw.x_val - mean) / std, atol=1e-5)
        np.testing.assert_array_equal(done.y_train, raw.y_train)
        np.testing.assert_allclose(done.x_train.mean(axis=0), 0.0, atol=1e-5)
        assert np.isfinite(done.x_val).all()
        # What it tells the server: raw, its own scale; standardised, about 1.
        assert done.feature_scale == pytest.approx(1.0, abs=1e-5)
        assert (raw.feature_scale > 10) == (name == "far")


def test_a_malformed_flag_is_a_config_error(tmp_path: Path) -> None:
    write_site(tmp_path / "s.npz", 0.0, 1.0, seed=0)
    node = {keys.DATA_PATH: str(tmp_path / "s.npz")}
    with pytest.raises(ConfigError, match="standardize-features"):
        load_site(node, {"standardize-features": "maybe"})
