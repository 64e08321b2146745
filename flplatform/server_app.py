"""The flplatform ServerApp (``flwr run .`` and ``flplatform simulate`` both run it).

A Flower app may pair it with its own ClientApp and declare its own run-config keys beside
ours (``learning-rate`` for its training loop, say): those are not ours and are skipped
here, named once in the log.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flplatform.config import RunConfig
from flplatform.federation import run_federation

log = logging.getLogger("flplatform")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Parse the run config once (skipping the app's own keys), then run the federation."""
    ignored = RunConfig.unknown_keys(context.run_config)
    if ignored:
        log.info("run config: keys not ours, left to the app: %s", ", ".join(ignored))
    run_federation(grid, RunConfig.from_mapping(context.run_config, allow_unknown=True))
