"""The site registry `flplatform server` writes and the ServerApp reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from flplatform.core.errors import ConfigError
from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry

LONDON = RegisteredSite("london", 18446744073709551615, "SHA256:aaa")  # the largest uint64
OHIO = RegisteredSite("ohio", 7, "SHA256:bbb")


def test_written_registry_reads_back_with_ids_names_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    SiteRegistry((LONDON, OHIO)).write(path)
    registry = SiteRegistry.from_environment({REGISTRY_ENV: str(path)})
    assert registry == SiteRegistry((LONDON, OHIO))
    assert registry.name_of(LONDON.node_id) == "london"
    assert registry.name_of(8) is None
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]  # nothing left aside


def test_unset_variable_means_no_registry() -> None:
    assert SiteRegistry.from_environment({}) is None


def test_with_site_replaces_the_entry_of_that_name() -> None:
    moved = RegisteredSite("ohio", 9, "SHA256:new")
    assert SiteRegistry((LONDON, OHIO)).with_site(moved).sites == (LONDON, moved)


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "cannot read"),
        ('{"format": "other"}', "not a site registry"),
        ('{"format": "flplatform-site-registry", "sites": [{"name": "a"}]}', "malformed"),
        (
            '{"format": "flplatform-site-registry", "sites": '
            '[{"name": "a", "node_id": -1, "fingerprint": "x"}]}',
            "non-negative",
        ),
        (
            '{"format": "flplatform-site-registry", "sites": ['
            '{"name": "a", "node_id": 1, "fingerprint": "x"},'
            '{"name": "b", "node_id": 1, "fingerprint": "y"}]}',
            "node id appears twice",
        ),
    ],
)
def test_a_damaged_registry_is_a_config_error_naming_the_file(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "registry.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as caught:
        SiteRegistry.read(path)
    assert "registry" in caught.value.reason


def test_a_missing_registry_file_is_named() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        SiteRegistry.from_environment({REGISTRY_ENV: "/nonexistent/registry.json"})
