"""The flplatform ServerApp (``flwr run .`` and ``flplatform simulate`` both run it).

A Flower app may pair it with its own ClientApp and declare its own run-config keys beside
ours (``learning-rate`` for its training loop, say): those are not ours and are skipped
here, named once in the log. A run config holding a sweep (``sweep``, written by
``flplatform.app.sweep``) runs each of its members in turn on the same sites.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flplatform.app.config import RunConfig
from flplatform.app.federation import run_federation, run_members
from flplatform.app.sweep import sweep_app_keys, sweep_members

log = logging.getLogger("flplatform")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Parse the run config once (skipping the app's own keys), then run the federation,
    or each run of a sweep."""
    ignored = RunConfig.unknown_keys(context.run_config)
    if ignored:
        log.info("run config: keys not ours, left to the app: %s", ", ".join(ignored))
    members = sweep_members(context.run_config)
    if members:
        run_members(
            grid,
            members,
            app_keys=sweep_app_keys(context.run_config),
            sites_run_config=context.run_config,
        )
    else:
        run_federation(grid, RunConfig.from_mapping(context.run_config, allow_unknown=True))
