"""Flower's internals in one place: the supported range said once, a moved internal named."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest.mock import patch

import pytest

from flplatform.core import flower_internals
from flplatform.core.errors import ConfigError, FlowerVersionError
from flplatform.core.flower_internals import (
    SUPPORTED_FLOWER,
    flower_version,
    internal,
    max_array_chunk_size,
    release,
)
from flplatform.deploy.superlink import FLOWER_VERSION_FILE, claim_superlink_database

ROOT = Path(__file__).resolve().parents[2]


def test_the_pin_is_the_supported_range_and_the_installed_flower_is_in_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [pin] = [d for d in project["dependencies"] if d.startswith("flwr")]
    oldest, beyond = SUPPORTED_FLOWER
    assert pin == f"flwr[simulation]>={oldest},<{beyond}"
    assert release(oldest) <= release(flower_version()) < release(beyond)


@pytest.mark.parametrize(
    "module,name",
    [
        ("flwr.app", "NoSuchRecord"),  # a name gone from a module
        ("flwr.no_such_module", "Anything"),  # a module gone
        ("flwr.app", "ArrayRecord.no_such_member"),  # a member gone from a class
    ],
)
def test_an_internal_the_installed_flower_lacks_is_named_with_the_version(
    module: str, name: str
) -> None:
    with pytest.raises(FlowerVersionError) as caught:
        internal(module, name)
    message = str(caught.value)
    assert f"{module}.{name}" in message
    assert f"Flower {flower_version()}" in message
    assert "pip install 'flwr[simulation]>=1.41.0,<1.43'" in message


def test_every_internal_of_the_installed_flower_is_found() -> None:
    # The lazy ones too (the eager ones were found when the module was imported).
    assert callable(flower_internals.actor_pool().add_actor_back_to_pool)
    assert callable(flower_internals.simulation_entry_point())
    assert callable(flower_internals.publish_filter())
    assert "[superlink" in flower_internals.default_flower_config()
    assert flower_internals.import_lock() is not None
    validate_config, flatten_dict = flower_internals.app_config_checks()
    assert callable(validate_config) and flatten_dict({"a": {"b": 1}}) == {"a.b": 1}


# Flower's public API: what a Flower app itself imports.
PUBLIC_FLOWER = {"flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp"}


def test_only_the_internals_module_reaches_past_flowers_public_api() -> None:
    """A moved internal must fail in one place with a clear message: every other module
    of the platform imports only Flower's public packages."""
    outside = []
    for package in ("flplatform", "clients", "strategies", "storage"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "flower_internals.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                outside += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {module}"
                    for module in modules
                    if module.split(".")[0] == "flwr" and module not in PUBLIC_FLOWER
                ]
    assert not outside, outside


def test_the_chunk_size_is_read_when_asked_for() -> None:
    import flwr.app.message.array as flower_array

    with patch.object(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 40):
        assert max_array_chunk_size() == 40
    assert max_array_chunk_size() == flower_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE


@pytest.mark.parametrize(
    "text,numbers",
    [("1.42.0", (1, 42, 0)), ("1.43", (1, 43)), ("1.42.0rc1", (1, 42, 0)), ("2.0.dev3", (2, 0))],
)
def test_a_release_orders_versions_by_their_numbers(text: str, numbers: tuple[int, ...]) -> None:
    assert release(text) == numbers


def test_a_superlink_database_a_newer_flower_opened_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    # Flower migrates the database forward on start; an older Flower then cannot open it.
    recorded = tmp_path / FLOWER_VERSION_FILE
    claim_superlink_database(tmp_path)  # a new deployment: the installed Flower recorded
    assert recorded.read_text() == f"{flower_version()}\n"
    assert recorded.stat().st_mode & 0o777 == 0o600
    claim_superlink_database(tmp_path)  # the same Flower again: fine

    major, minor, patch = (*release(flower_version()), 0, 0)[:3]
    newer = f"{major}.{minor}.{patch + 1}"  # a patch release: within the supported range
    recorded.write_text(f"{newer}\n")
    with pytest.raises(ConfigError) as caught:
        claim_superlink_database(tmp_path)
    message = str(caught.value)
    assert f"opened by Flower {newer}" in message and f"({flower_version()})" in message
    assert f"pip install 'flwr[simulation]=={newer}'" in message and str(tmp_path) in message
    assert recorded.read_text() == f"{newer}\n"  # nothing overwritten
    recorded.write_text("9.0.0\n")  # beyond what flplatform supports: only a fresh start
    with pytest.raises(ConfigError, match=r"No Flower flplatform supports \(>= 1.41.0, < 1.43\)"):
        claim_superlink_database(tmp_path)

    recorded.write_text("1.0.0\n")  # an older Flower opened it: migrated forward on start
    claim_superlink_database(tmp_path)
    assert recorded.read_text() == f"{flower_version()}\n"


def test_the_cli_says_in_one_line_what_the_installed_flower_lacks() -> None:
    # As if a Flower release had moved an internal: the CLI fails while its modules import.
    code = (
        "import sys, flwr.proto.fleet_pb2 as fleet\n"
        "del fleet.Reconnect\n"
        "sys.argv = ['flplatform', '--help']\n"
        "from flplatform.cli import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.startswith("error: flplatform needs Flower's flwr.proto.fleet_pb2.Reconnect")
    assert done.stderr.count("\n") == 1
