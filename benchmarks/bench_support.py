"""What the simulated-federation benchmarks share: their sites, a fresh home, JSON output."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

# The world network's four cities, twice: 8 sites.
SITES = ("london", "ohio", "california", "tokyo", "london-2", "ohio-2", "california-2", "tokyo-2")


def fresh_home() -> Path:
    """A new FLPLATFORM_HOME for this run (its ledger lives there); no runtime installs."""
    home = Path(tempfile.mkdtemp(prefix="flplatform-bench-"))
    os.environ["FLPLATFORM_HOME"] = str(home)
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    return home


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the report as JSON, and write it to ``out`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
