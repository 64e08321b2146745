"""Split a dataset into one file per site, for deployments where each site holds only its own.

:func:`write_site_files` partitions the training split of a dataset (built-in or ``.npz``) and
writes, into one folder::

    <site>.npz       arrays x, y: that site's partition of the training split
    test.npz         arrays x, y: the held-out test split, for central evaluation
    manifest.json    dataset, scheme, alpha, seed, and each file's count and label histogram

Each file is written to a temporary name and renamed into place, and ``manifest.json`` is
written last, so a folder without a manifest is an interrupted split. A deployed site copies
only its own ``<site>.npz`` and reads it with :func:`clients.datasets.load_site_file`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from clients.datasets import load_dataset
from clients.partitioning import PARTITION_SCHEMES, partition_indices
from flplatform.core.checks import SITE_NAME, check_positive, check_seed
from flplatform.core.errors import ConfigError, DataError

__all__ = [
    "MANIFEST_FILE",
    "TEST_FILE",
    "SiteSplit",
    "SplitManifest",
    "read_manifest",
    "write_site_files",
]

MANIFEST_FILE = "manifest.json"
TEST_FILE = "test.npz"
_FORMAT = "flplatform-site-split"
_VERSION = 1

# Site names (flplatform.core.checks.SITE_NAME) are safe as a file name on every platform and
# never a hidden file, an option (leading '-') or a path ('/', '..').
# Compared case-insensitively: on macOS and Windows "Test.npz" is the same file as "test.npz".
_RESERVED_NAMES = ("test", "manifest")


@dataclass(frozen=True)
class SiteSplit:
    """One written file of a split.

    Parameters
    ----------
    name : str
        The site's name (``"test"`` for the held-out test file).
    path : pathlib.Path
        Where the file is.
    num_examples : int
        Number of examples in it.
    label_counts : tuple of int
        Examples per class, ``label_counts[c]`` for class ``c``.
    """

    name: str
    path: Path
    num_examples: int
    label_counts: tuple[int, ...]


@dataclass(frozen=True)
class SplitManifest:
    """What :func:`write_site_files` wrote, as recorded in ``manifest.json``.

    Parameters
    ----------
    dataset : str
        The dataset name or path that was split.
    scheme : str
        The partition scheme, one of ``PARTITION_SCHEMES``.
    alpha : float or None
        Dirichlet concentration; ``None`` for ``"iid"``.
    seed : int
        Seed of the test split and of the partition.
    test_fraction : float
        Test share asked for (unused by datasets with an official or given test split).
    num_classes : int
        Number of classes of the dataset.
    input_shape : tuple of int
        Shape of one example, ``(C, H, W)``.
    sites : tuple of SiteSplit
        The site files, in the order the sites were given.
    test : SiteSplit
        The held-out test file.
    manifest_path : pathlib.Path
        Where ``manifest.json`` is.
    """

    dataset: str
    scheme: str
    alpha: float | None
    seed: int
    test_fraction: float
    num_classes: int
    input_shape: tuple[int, ...]
    sites: tuple[SiteSplit, ...]
    test: SiteSplit
    manifest_path: Path

    @property
    def site_paths(self) -> dict[str, Path]:
        """Site name → file path (a fresh dict, so callers may change it freely)."""
        return {site.name: site.path for site in self.sites}

    def describe(self) -> list[str]:
        """Plain-text lines summarising the split, one per file, for a terminal.

        Returns
        -------
        list of str
            A heading, one line per site and one for the test file (examples and per-class
            counts as ``class:count``), and the manifest's path.
        """
        skew = f"dirichlet alpha={self.alpha:g}" if self.alpha is not None else self.scheme
        folder = self.manifest_path.parent
        lines = [
            f"{self.dataset} split into {len(self.sites)} site files in {folder}"
            f" ({skew}, seed {self.seed})"
        ]
        width = max(len(split.name) for split in (*self.sites, self.test))
        for split in (*self.sites, self.test):
            counts = " ".join(f"{c}:{n}" for c, n in enumerate(split.label_counts))
            lines.append(
                f"  {split.name:<{width}}  {split.path.name:<{width + 4}}"
                f"  {split.num_examples:>6} examples  {counts}"
            )
        lines.append(f"manifest: {self.manifest_path}")
        return lines

    def site(self, name: str) -> SiteSplit:
        """Return the split of site ``name``.

        Raises
        ------
        ConfigError
            If there is no such site in this split.
        """
        for site in self.sites:
            if site.name == name:
                return site
        known = ", ".join(site.name for site in self.sites)
        raise ConfigError(f"no site {name!r} in {self.manifest_path}; its sites are: {known}")


def write_site_files(
    dataset: str,
    out_dir: str | os.PathLike[str],
    *,
    sites: Sequence[str],
    scheme: str = "dirichlet",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    overwrite: bool = False,
) -> SplitManifest:
    """Partition a dataset's training split and write one ``.npz`` file per site.

    Site ``sites[i]`` receives partition ``i`` of
    ``partition_indices(y_train, len(sites), scheme=scheme, alpha=alpha, seed=seed)``, the
    same split a simulation with these settings uses, so a deployment can reproduce it.

    Parameters
    ----------
    dataset : str
        A built-in dataset name or a path to an ``.npz`` file (see ``load_dataset``).
    out_dir : str or os.PathLike
        Folder to write into; created if missing.
    sites : sequence of str
        Site names: unique (ignoring case), 1 to 64 characters of letters, digits, ``_``, ``.``
        and ``-``, starting with a letter or digit, and not ``test`` or ``manifest``.
    scheme : str
        ``"iid"`` or ``"dirichlet"``.
    alpha : float
        Dirichlet concentration (ignored by ``"iid"``).
    seed : int
        Seed of the test split and of the partition.
    test_fraction : float
        Share of the dataset held out as ``test.npz`` (see ``load_dataset``).
    overwrite : bool
        Replace files of an earlier split in ``out_dir``; without it, existing files are an
        error. Files of sites not in ``sites`` are left alone either way.

    Returns
    -------
    SplitManifest
        The paths and counts written.

    Raises
    ------
    ConfigError
        If a site name, the scheme or a parameter is invalid.
    DataError
        If the dataset cannot be loaded or partitioned, a file exists and ``overwrite`` is
        false, or a file cannot be written.
    """
    names = _check_site_names(sites)
    if scheme not in PARTITION_SCHEMES:
        raise ConfigError(
            f"unknown partition scheme {scheme!r}; allowed: {', '.join(PARTITION_SCHEMES)}"
        )
    seed = check_seed(seed)
    if scheme == "dirichlet":
        # Checked before the (possibly slow) load, so a typo fails at once.
        alpha = check_positive(alpha, name="alpha")
    folder = Path(out_dir)
    targets = [folder / f"{name}.npz" for name in names] + [folder / TEST_FILE]
    existing = [path for path in [*targets, folder / MANIFEST_FILE] if path.exists()]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise DataError(
            f"{existing[0]} already exists{more}; refusing to overwrite an earlier split, pass"
            " overwrite=True to replace it or choose another folder"
        )

    data = load_dataset(dataset, seed=seed, test_fraction=test_fraction)
    parts = partition_indices(data.y_train, len(names), scheme=scheme, alpha=alpha, seed=seed)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create folder {folder} ({exc})") from exc

    written = []
    for name, indices, target in zip(names, parts, targets[:-1], strict=True):
        y = data.y_train[indices]
        _write_npz(target, x=data.x_train[indices], y=y)
        written.append(SiteSplit(name, target, len(y), _histogram(y, data.num_classes)))
    _write_npz(folder / TEST_FILE, x=data.x_test, y=data.y_test)
    test_counts = _histogram(data.y_test, data.num_classes)
    test = SiteSplit("test", folder / TEST_FILE, len(data.y_test), test_counts)

    manifest = SplitManifest(
        dataset=str(dataset),
        scheme=scheme,
        alpha=float(alpha) if scheme == "dirichlet" else None,
        seed=seed,
        test_fraction=float(test_fraction),
        num_classes=data.num_classes,
        input_shape=data.input_shape,
        sites=tuple(written),
        test=test,
        manifest_path=folder / MANIFEST_FILE,
    )
    text = json.dumps(_manifest_to_json(manifest), indent=2) + "\n"
    _write_atomic(manifest.manifest_path, lambda stream: stream.write(text.encode()))
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> SplitManifest:
    """Read the ``manifest.json`` of a split (give the file or its folder).

    File paths in the result are resolved against the manifest's folder, so a split folder can
    be moved or copied as a whole.

    Parameters
    ----------
    path : str or os.PathLike
        ``manifest.json`` or the folder holding it.

    Returns
    -------
    SplitManifest
        The recorded split.

    Raises
    ------
    DataError
        If the manifest is missing, not JSON, or lacks a field.
    """
    file = Path(path)
    if file.is_dir():
        file = file / MANIFEST_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"{file}: cannot read the split manifest ({exc})") from exc
    except ValueError as exc:
        raise DataError(f"{file}: not a JSON split manifest ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise DataError(f"{file}: not a split manifest written by write_site_files")
    if record.get("version") != _VERSION:
        raise DataError(
            f"{file}: split manifest version {record.get('version')!r} is not supported;"
            f" this flplatform reads version {_VERSION}"
        )

    def entry(item: dict[str, Any]) -> SiteSplit:
        return SiteSplit(
            name=str(item["name"]),
            path=file.parent / str(item["file"]),
            num_examples=int(item["num_examples"]),
            label_counts=tuple(int(count) for count in item["label_counts"]),
        )

    try:
        return SplitManifest(
            dataset=str(record["dataset"]),
            scheme=str(record["scheme"]),
            alpha=None if record["alpha"] is None else float(record["alpha"]),
            seed=int(record["seed"]),
            test_fraction=float(record["test_fraction"]),
            num_classes=int(record["num_classes"]),
            input_shape=tuple(int(d) for d in record["input_shape"]),
            sites=tuple(entry(item) for item in record["sites"]),
            test=entry(record["test"]),
            manifest_path=file,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{file}: split manifest is missing or has a malformed field ({exc!r})"
        ) from exc


# ------------------------------------------------------------------------------------ helpers


def _check_site_names(sites: Sequence[str]) -> list[str]:
    if isinstance(sites, str):
        raise ConfigError(f"sites must be a list of site names, not one string ({sites!r})")
    names = list(sites)
    if not names:
        raise ConfigError("sites must name at least one site")
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not SITE_NAME.fullmatch(name):
            raise ConfigError(
                f"site name {name!r} is not allowed; use 1-64 letters, digits, '_', '.' or '-',"
                " starting with a letter or digit"
            )
        if name.lower() in _RESERVED_NAMES:
            raise ConfigError(
                f"site name {name!r} is reserved for the split's own files; choose another"
            )
        if name.lower() in seen:
            raise ConfigError(
                f"site name {name!r} is given twice (names are compared ignoring case)"
            )
        seen.add(name.lower())
    return names


def _histogram(labels: np.ndarray, num_classes: int) -> tuple[int, ...]:
    return tuple(int(count) for count in np.bincount(labels, minlength=num_classes))


def _write_npz(target: Path, *, x: np.ndarray, y: np.ndarray) -> None:
    _write_atomic(target, lambda stream: np.savez_compressed(stream, x=x, y=y))


def _write_atomic(target: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write via a temporary file in the same folder, then rename over ``target``.

    A reader never sees a half-written file: the rename is atomic within one filesystem.
    """
    try:
        handle, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        )
    except OSError as exc:
        raise DataError(f"cannot write {target} ({exc})") from exc
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise DataError(f"cannot write {target} ({exc})") from exc
        raise


def _manifest_to_json(manifest: SplitManifest) -> dict[str, Any]:
    def entry(split: SiteSplit) -> dict[str, Any]:
        return {
            "name": split.name,
            # Relative, so the folder can be moved or copied to the sites as a whole.
            "file": split.path.name,
            "num_examples": split.num_examples,
            "label_counts": list(split.label_counts),
        }

    return {
        "format": _FORMAT,
        "version": _VERSION,
        "dataset": manifest.dataset,
        "scheme": manifest.scheme,
        "alpha": manifest.alpha,
        "seed": manifest.seed,
        "test_fraction": manifest.test_fraction,
        "num_classes": manifest.num_classes,
        "input_shape": list(manifest.input_shape),
        "sites": [entry(site) for site in manifest.sites],
        "test": entry(manifest.test),
    }
