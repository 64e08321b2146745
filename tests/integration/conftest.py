"""Fixtures for integration tests that start real Flower processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hostile_app(tmp_path: Path) -> Path:
    """A Flower app directory: flplatform's ServerApp with a misbehaving ClientApp."""
    app_dir = tmp_path / "hostile-app"
    app_dir.mkdir()
    text = (ROOT / "pyproject.toml").read_text()
    text = text.replace('name = "flplatform"', 'name = "flplatform-hostile-test"', 1)
    text = text.replace('readme = "README.md"\n', "", 1)
    text = text.replace(
        'clientapp = "clients.client_app:app"', 'clientapp = "hostile_client:app"', 1
    )
    (app_dir / "pyproject.toml").write_text(text)
    shutil.copy(Path(__file__).parent / "apps" / "hostile_client.py", app_dir)
    return app_dir
