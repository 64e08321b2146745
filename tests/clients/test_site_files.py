"""Tests of clients.site_files: per-site files, the manifest, overwrite refusal, site names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clients.datasets import load_dataset, load_site_file
from clients.partitioning import partition_indices
from clients.site_files import MANIFEST_FILE, TEST_FILE, read_manifest, write_site_files
from flplatform.core.errors import ConfigError, DataError
from tests.helpers.data_files import sorted_rows

SITES = ["london", "ohio", "california", "tokyo"]


def test_site_files_partition_the_training_split(tmp_path: Path) -> None:
    manifest = write_site_files("digits", tmp_path, sites=SITES, alpha=0.5, seed=3)
    data = load_dataset("digits", seed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{site}.npz" for site in SITES] + [TEST_FILE, MANIFEST_FILE]
    )

    xs, ys = [], []
    expected_parts = partition_indices(data.y_train, 4, scheme="dirichlet", alpha=0.5, seed=3)
    for name, site, part in zip(SITES, manifest.sites, expected_parts, strict=True):
        x, y = load_site_file(tmp_path / f"{name}.npz")
        assert site.name == name and site.path == tmp_path / f"{name}.npz"
        assert x.dtype == np.float32 and x.shape[1:] == (1, 8, 8) and y.dtype == np.int64
        assert site.num_examples == len(y)
        assert site.label_counts == tuple(np.bincount(y, minlength=10))
        # Site i holds partition i of the same split a simulation computes from the seed.
        np.testing.assert_array_equal(y, data.y_train[part])
        np.testing.assert_array_equal(x, data.x_train[part])
        xs.append(x)
        ys.append(y)
    # The union of the site files is the training set, as multisets of (x, y).
    np.testing.assert_array_equal(
        sorted_rows(np.concatenate(xs), np.concatenate(ys)),
        sorted_rows(data.x_train, data.y_train),
    )

    x_test, y_test = load_site_file(tmp_path / TEST_FILE)
    np.testing.assert_array_equal(x_test, data.x_test)
    np.testing.assert_array_equal(y_test, data.y_test)
    assert manifest.test.num_examples == 359
    assert manifest.test.label_counts == tuple(np.bincount(data.y_test, minlength=10))
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_manifest_records_the_split(tmp_path: Path) -> None:
    manifest = write_site_files("digits", tmp_path, sites=["a", "b"], scheme="iid", seed=1)
    record = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert record["dataset"] == "digits" and record["scheme"] == "iid"
    assert record["alpha"] is None and record["seed"] == 1
    assert record["num_classes"] == 10 and record["input_shape"] == [1, 8, 8]
    assert [site["file"] for site in record["sites"]] == ["a.npz", "b.npz"]
    assert [site["num_examples"] for site in record["sites"]] == [719, 719]  # 1438 / 2
    assert sum(map(sum, (site["label_counts"] for site in record["sites"]))) == 1438
    assert read_manifest(tmp_path) == manifest
    assert read_manifest(tmp_path / MANIFEST_FILE).site("b").path == tmp_path / "b.npz"
    assert manifest.site_paths == {"a": tmp_path / "a.npz", "b": tmp_path / "b.npz"}
    with pytest.raises(ConfigError, match="no site 'c'"):
        manifest.site("c")


def test_a_moved_split_folder_still_reads(tmp_path: Path) -> None:
    write_site_files("digits", tmp_path / "old", sites=["a", "b"], scheme="iid")
    (tmp_path / "old").rename(tmp_path / "new")
    manifest = read_manifest(tmp_path / "new")
    x, _ = load_site_file(manifest.site("a").path)
    assert len(x) == manifest.site("a").num_examples


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    write_site_files("digits", tmp_path, sites=["a", "b"], scheme="iid", seed=0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(DataError, match="overwrite=True"):
        write_site_files("digits", tmp_path, sites=["b", "c"], scheme="iid", seed=1)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched

    manifest = write_site_files("digits", tmp_path, sites=["a", "b"], seed=1, overwrite=True)
    assert manifest.scheme == "dirichlet" and read_manifest(tmp_path).seed == 1
    assert (tmp_path / "a.npz").read_bytes() != before["a.npz"]


def test_a_users_npz_can_be_split(tmp_path: Path) -> None:
    source = tmp_path / "mine.npz"
    np.savez(source, x=np.arange(40 * 5, dtype=np.float32).reshape(40, 5), y=np.arange(40) % 4)
    manifest = write_site_files(str(source), tmp_path / "split", sites=["a", "b"], scheme="iid")
    assert manifest.input_shape == (1, 1, 5)
    assert [site.num_examples for site in manifest.sites] == [16, 16]
    assert manifest.test.num_examples == 8


@pytest.mark.parametrize(
    "sites",
    [
        [""],
        ["a/b"],
        [".."],
        [".hidden"],
        ["-rf"],
        ["with space"],
        ["x" * 65],
        ["test"],
        ["Manifest"],
        ["london", "London"],
        [],
        "london",
        [3],
    ],
    ids=repr,
)
def test_bad_site_names(tmp_path: Path, sites: object) -> None:
    with pytest.raises(ConfigError, match="site"):
        write_site_files("digits", tmp_path / "out", sites=sites)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_bad_scheme_and_alpha_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allowed: iid, dirichlet"):
        write_site_files("digits", tmp_path / "out", sites=["a"], scheme="skewed")
    with pytest.raises(ConfigError, match="alpha"):
        write_site_files("digits", tmp_path / "out", sites=["a"], alpha=0.0)
    with pytest.raises(ConfigError, match="unknown dataset"):
        write_site_files("nope", tmp_path / "out", sites=["a"])
    assert not (tmp_path / "out").exists()


def test_more_sites_than_examples(tmp_path: Path) -> None:
    source = tmp_path / "tiny.npz"
    np.savez(source, x=np.ones((5, 4)), y=np.arange(5) % 2)
    sites = [f"s{i}" for i in range(5)]  # 4 training examples after the test split
    with pytest.raises(ConfigError, match="num_partitions"):
        write_site_files(str(source), tmp_path / "out", sites=sites, scheme="iid")


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DataError, match="not a JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text('{"format": "flplatform-site-split", "version": 1}')
    with pytest.raises(DataError, match="malformed field"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text('{"format": "flplatform-site-split", "version": 9}')
    with pytest.raises(DataError, match="version 9"):
        read_manifest(tmp_path)


def test_describe_lists_every_file(tmp_path: Path) -> None:
    manifest = write_site_files("digits", tmp_path, sites=["a", "bb"], alpha=2.0, seed=4)
    lines = manifest.describe()
    assert lines[0] == f"digits split into 2 site files in {tmp_path} (dirichlet alpha=2, seed 4)"
    a, b = manifest.sites
    assert lines[1].split()[:4] == ["a", "a.npz", str(a.num_examples), "examples"]
    assert lines[2].split()[:4] == ["bb", "bb.npz", str(b.num_examples), "examples"]
    assert lines[3].split()[:3] == ["test", "test.npz", "359"]
    assert lines[1].split()[4:] == [f"{c}:{n}" for c, n in enumerate(a.label_counts)]
    assert lines[-1] == f"manifest: {tmp_path / MANIFEST_FILE}"
