"""flplatform: communication-efficient cross-silo federated learning on Flower.

``flplatform.start(strategy, grid, arrays, ...)`` is a ServerApp's one call that adds the
platform's synchrony modes, simulated networks and ledger (see ``flplatform.start``). It
is loaded on first use: sites import ``flplatform.keys`` and ``flplatform.errors``, which
must not pull in the round engine or Flower's ServerApp.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``flplatform.start``, imported lazily (the module is callable: it calls ``start``)."""
    if name == "start":
        return importlib.import_module("flplatform.start")
    raise AttributeError(f"module 'flplatform' has no attribute {name!r}")
