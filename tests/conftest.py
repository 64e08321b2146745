"""Shared fixtures: Flower's task identity for tests that build messages, isolated homes,
and a PostgreSQL server with fresh databases (``tests/postgres.py``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

# Any test may take `postgres_database` or `password_database`.
pytest_plugins = ["tests.postgres"]

# Flower and Ray must never write to ~/.flwr or phone home from the test suite.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


@pytest.fixture(autouse=True)
def site_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's sites keep their snapshots (strategies/mods/snapshots.py) to themselves."""
    directory = tmp_path / "site-state"
    monkeypatch.setenv("FLPLATFORM_SITE_STATE", str(directory))
    return directory


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Let a test build ``Message`` objects outside a running app."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id = 7
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 3
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # type: ignore[attr-defined]


@pytest.fixture
def flplatform_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private FLPLATFORM_HOME (ledger, Flower state, logs) for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FLPLATFORM_HOME", str(home))
    monkeypatch.setenv("FLWR_HOME", str(home / "flwr"))
    return home


@pytest.fixture
def live_sigint() -> Iterator[None]:
    """SIGINT handled as in a terminal (Python's KeyboardInterrupt) for the test's duration.

    A test run started in the background by a non-interactive shell inherits SIGINT
    ignored, and the platform keeps an ignored SIGINT ignored (as that shell meant); tests
    of its SIGINT handling put Python's own handler back first.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
