"""The flplatform ServerApp (``flwr run .`` and ``flplatform simulate`` both run it)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flplatform.config import RunConfig
from flplatform.federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Parse the run config once, then run the federation."""
    run_federation(grid, RunConfig.from_mapping(context.run_config))
