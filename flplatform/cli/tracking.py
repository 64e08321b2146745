"""``flplatform history export``: runs of the ledger to MLflow and TensorBoard."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from flplatform.app.tracking import run_series, to_mlflow, to_tensorboard
from flplatform.cli.errors import handles_errors
from flplatform.cli.export import model_arrays, write_model
from flplatform.cli.history import DbOption, RunsArgument, console, resolve_run
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, NotFoundError
from flplatform.run.ledger import load_checkpoint
from storage import LedgerRepository


@handles_errors
def export_runs(
    selected: RunsArgument,
    mlflow: Annotated[
        str | None,
        typer.Option(
            "--mlflow",
            metavar="URI",
            help="MLflow tracking URI to write each run to (sqlite:///mlflow.db, "
            "http://host:5000); needs pip install 'flplatform\\[mlflow]'.",
        ),
    ] = None,
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            "--tensorboard",
            metavar="DIR",
            help="Folder to write TensorBoard event files to, one subfolder per run; needs "
            "pip install 'flplatform\\[tensorboard]'.",
        ),
    ] = None,
    experiment: Annotated[
        str, typer.Option(help="The MLflow experiment the runs go to (created if missing).")
    ] = "flplatform",
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier export of the same runs.")
    ] = False,
    db: DbOption = None,
) -> None:
    """Write runs to MLflow or TensorBoard: per round (the step) accuracy, losses, bytes
    up and down, updates applied, rejected and dropped, wall and simulated time and
    staleness; per site its bytes, applied updates, staleness and loss (site/NAME/...);
    the run's options as parameters; to MLflow also the final model (model.pt)."""
    if mlflow is None and tensorboard is None:
        raise ConfigError("say where to export: --mlflow URI, --tensorboard DIR, or both")
    if tensorboard is not None and tensorboard.exists() and not tensorboard.is_dir():
        raise ConfigError(f"--tensorboard must be a folder, and {tensorboard} is a file")
    with (
        LedgerRepository.open(db, create=False) as repository,
        tempfile.TemporaryDirectory(prefix="flplatform-export-") as scratch,
    ):
        run_ids = list(dict.fromkeys(resolve_run(repository, run) for run in selected))
        runs = [run_series(repository, run_id) for run_id in run_ids]
        if tensorboard is not None:
            folders = to_tensorboard(runs, tensorboard, replace=force)
            for series in runs:
                folder = folders[series.run_id]
                console.print(Text(f"Run {series.run_id} ({series.name}) → TensorBoard: {folder}"))
        if mlflow is not None:
            models = {}
            for run_id in run_ids:
                model = _final_model(repository, run_id, Path(scratch) / str(run_id))
                if model is not None:
                    models[run_id] = model
            written = to_mlflow(
                runs, mlflow, experiment=experiment, artifacts=models, replace=force
            )
            for series in runs:
                note = "" if series.run_id in models else " (no checkpoint: no model)"
                console.print(
                    Text(
                        f"Run {series.run_id} ({series.name}) → MLflow run "
                        f"{written[series.run_id]} in experiment '{experiment}'{note}"
                    )
                )


def _final_model(repository: LedgerRepository, run_id: int, folder: Path) -> Path | None:
    """The run's latest checkpointed model as ``folder/model.pt``; None without one."""
    try:
        checkpoint, state = load_checkpoint(repository, run_id, None)
    except (NotFoundError, CheckpointError):
        return None
    folder.mkdir(parents=True)
    path = folder / "model.pt"
    write_model(path, model_arrays(state, f"the checkpoint of round {checkpoint.round}"))
    return path
