"""flplatform: communication-efficient cross-silo federated learning on Flower.

``flplatform.start(strategy, grid, arrays, ...)`` is a ServerApp's one call that adds the
platform's synchrony modes, simulated networks and ledger (see ``flplatform.run.start``). It
is loaded on first use: sites import ``flplatform.core.keys`` and ``flplatform.core.errors``, which
must not pull in the round engine or Flower's ServerApp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flplatform.run.start import start as start

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``flplatform.start``, the function, imported on first use."""
    if name == "start":
        return importlib.import_module("flplatform.run.start").start
    raise AttributeError(f"module 'flplatform' has no attribute {name!r}")
