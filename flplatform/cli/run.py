"""``flplatform run APP_DIR``: run a user's own Flower app in a local simulation.

As ``flwr run APP_DIR`` would, with the platform's options on top (see
flplatform/launch/app_directory.py for how each reaches the app). Everything is checked before any
process starts; the run is followed through the ledger and its tables printed at the end.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from flplatform.cli.errors import handles_errors
from flplatform.cli.history import rounds as show_rounds
from flplatform.cli.history import sites as show_sites
from flplatform.cli.options import table_options
from flplatform.cli.progress import round_progress, say_run_done
from flplatform.cli.render import OutputFormat, make_console
from flplatform.cli.simulate import Tracking, site_names
from flplatform.cli.tracking import (
    ExperimentOption,
    MlflowOption,
    TensorboardOption,
    check_folder,
    exporting,
    live_export,
)
from flplatform.launch.app_directory import (
    RUN_CONFIG_KEYS,
    AppRun,
    RunOverrides,
    plan_run,
    read_app,
)
from flplatform.launch.simulation import run_app
from storage import RunRecord

console = make_console()

# The platform's options a user's app takes from the run options' table (launch/
# app_directory.py's RunOverrides says where each goes); --sites is this command's own.
APP_OPTIONS = tuple(name for name in RUN_CONFIG_KEYS if name != "sites")
APP_OPTION_HELPS = {
    "rounds": "Server rounds (the app's num-server-rounds and start's num_rounds).",
    "k": "K of the K synchrony modes.",
    "seed": "Seed of the platform's random choices.",
    "strategy": "Sets the app's `strategy` key (flplatform's ServerApp: the algorithm).",
    "model": "Sets the app's `model` key: mlp, cnn, wide-mlp, or MODULE:FACTORY (a "
    "zero-argument callable returning an nn.Module, importable from the app "
    "directory or the Python path).",
    "name": "The run's name in the ledger (start()'s name; default: the app's choice).",
}


@handles_errors
@table_options(only=APP_OPTIONS, optional=True, helps=APP_OPTION_HELPS)
def run(
    app_dir: Annotated[
        Path,
        typer.Argument(
            help="A Flower app directory: pyproject.toml with [tool.flwr.app].",
            show_default=False,
        ),
    ],
    sites: Annotated[
        str | None,
        typer.Option(
            help="Number of simulated sites (SuperNodes), or comma-separated names "
            "(default: the app's `sites` key, else 2)."
        ),
    ] = None,
    db: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the ledger (default: the SQLite ledger)."),
    ] = None,
    run_config: Annotated[
        list[str] | None,
        typer.Option(
            "--run-config",
            "-c",
            help="key=value of the app's own run config (repeatable); the key must be "
            "declared in the app's pyproject.toml.",
        ),
    ] = None,
    mlflow: MlflowOption = None,
    tensorboard: TensorboardOption = None,
    experiment: ExperimentOption = "flplatform",
    **options: Any,
) -> None:
    """Run your own Flower app directory in a local simulation, with the platform's options."""
    check_folder(tensorboard)
    app = read_app(app_dir)
    given = RunOverrides(
        sites=site_names(sites) if sites is not None else None,
        db=db,
        **options,
        run_config=tuple(run_config or ()),
    )
    plan = plan_run(app, given, tag=uuid.uuid4().hex)
    record = follow(plan, Tracking(mlflow, tensorboard, experiment))
    show_rounds(str(record.id), db=plan.db_url, fmt=OutputFormat.table)
    show_sites(str(record.id), db=plan.db_url, fmt=OutputFormat.table)
    say_run_done(console, record, plan.db_url, db)


def follow(plan: AppRun, tracking: Tracking | None = None) -> RunRecord:
    """Start the app and show its rounds as they finish (and log them to ``tracking``'s
    stores); return the finished run."""
    shown = {
        key: plan.options[key]
        for key in ("num_rounds", "sync", "k", "network", "seed")
        if key in plan.options
    }
    extras = "".join(f", {key}={value}" for key, value in shown.items())
    own = " ".join(
        f"{key}={value}" for key, value in plan.run_config.items() if key not in ("db", "run-tag")
    )
    console.print(
        Text.assemble(
            "Running app ",
            (plan.app.name, "bold"),
            f" ({plan.app.path}) on {plan.num_sites} simulated sites{extras}"
            + (f"; run config: {own}" if own else ""),
        )
    )
    with (
        live_export(plan.db_url, *(tracking or Tracking())) as live,
        round_progress(console, plan.num_rounds) as show,
    ):
        record = run_app(plan, on_progress=exporting(show, live))
    console.print()
    return record
