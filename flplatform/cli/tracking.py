"""Runs of the ledger to MLflow and TensorBoard: ``flplatform history export``, and the
``--mlflow``/``--tensorboard`` options with which ``simulate`` and ``run`` log live."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from flplatform.app.tracking import (
    LiveExport,
    check_tensorboard_free,
    run_series,
    to_mlflow,
    to_tensorboard,
)
from flplatform.cli.errors import handles_errors
from flplatform.cli.export import model_arrays, write_model
from flplatform.cli.history import DbOption, RunsArgument, console, read_ledger, resolve_run
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, NotFoundError
from flplatform.launch.simulation import ProgressCallback
from flplatform.run.ledger import load_checkpoint, owner_alive
from storage import RUN_RUNNING, LedgerRepository, RoundRecord, RunRecord, UpdateRecord

PANEL = "Experiment tracking"
MlflowOption = Annotated[
    str | None,
    typer.Option(
        "--mlflow",
        metavar="URI",
        help="MLflow tracking URI to write each run to (sqlite:///mlflow.db, "
        "http://host:5000); needs pip install 'flplatform\\[mlflow]'.",
        rich_help_panel=PANEL,
    ),
]
TensorboardOption = Annotated[
    Path | None,
    typer.Option(
        "--tensorboard",
        metavar="DIR",
        help="Folder to write TensorBoard event files to, one subfolder per run; needs "
        "pip install 'flplatform\\[tensorboard]'.",
        rich_help_panel=PANEL,
    ),
]
ExperimentOption = Annotated[
    str,
    typer.Option(
        help="The MLflow experiment the runs go to (created if missing).",
        rich_help_panel=PANEL,
    ),
]


@handles_errors
def export_runs(
    selected: RunsArgument,
    mlflow: MlflowOption = None,
    tensorboard: TensorboardOption = None,
    experiment: ExperimentOption = "flplatform",
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier export of the same runs.")
    ] = False,
    db: DbOption = None,
) -> None:
    """Write runs to MLflow or TensorBoard: metrics per round and per site, options, model.

    Per round (the step): accuracy, losses, bytes up and down, updates applied, rejected
    and dropped, wall and simulated time and staleness; per site its bytes, applied
    updates, staleness and loss (site/NAME/...); the run's options as parameters; to
    MLflow also the final model (model.pt)."""
    if mlflow is None and tensorboard is None:
        raise ConfigError("say where to export: --mlflow URI, --tensorboard DIR, or both")
    check_folder(tensorboard)
    with read_ledger(db) as repository:
        run_ids = [resolve_run(repository, run) for run in selected]
        for run_id in run_ids:
            record = repository.get_run(run_id)
            if record.status == RUN_RUNNING and owner_alive(record.owner):
                raise ConfigError(
                    f"run {run_id} is still training: export it once it ends (or log it "
                    "as it trains: simulate and run take --mlflow and --tensorboard)"
                )
    mlflow_fails_fast()
    export_to(db, run_ids, mlflow, tensorboard, experiment, force=force)


def check_folder(folder: Path | None, option: str = "--tensorboard") -> None:
    """Refuse, before anything starts, a folder option that names a file or lies under one
    (the run would train first and fail when it writes)."""
    if folder is None:
        return
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == folder else f"is under {existing}, a file"
        raise ConfigError(f"{option} must be a folder, and {folder} {where}")


def export_to(
    db: str | None,
    run_ids: Sequence[int],
    mlflow: str | None,
    tensorboard: Path | None,
    experiment: str,
    *,
    force: bool = False,
) -> None:
    """Write the runs to the stores given and say where each went."""
    with (
        LedgerRepository.open(db, create=False) as repository,
        tempfile.TemporaryDirectory(prefix="flplatform-export-") as scratch,
    ):
        run_ids = list(dict.fromkeys(run_ids))
        runs = [run_series(repository, run_id) for run_id in run_ids]
        if tensorboard is not None and not force:
            # refused before MLflow is written: a refusal leaves nothing half exported
            check_tensorboard_free(runs, tensorboard)
        if mlflow is not None:
            models = {}
            for run_id in run_ids:
                model = final_model(repository, run_id, Path(scratch) / str(run_id))
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
        if tensorboard is not None:  # after MLflow, which refuses a repeat before writing
            folders = to_tensorboard(runs, tensorboard, replace=force)
            for series in runs:
                folder = folders[series.run_id]
                console.print(Text(f"Run {series.run_id} ({series.name}) → TensorBoard: {folder}"))


def final_model(repository: LedgerRepository, run_id: int, folder: Path) -> Path | None:
    """The run's latest checkpointed model as ``folder/model.pt``; None without one."""
    try:
        checkpoint, state = load_checkpoint(repository, run_id, None)
    except (NotFoundError, CheckpointError):
        return None
    folder.mkdir(parents=True)
    path = folder / "model.pt"
    write_model(path, model_arrays(state, f"the checkpoint of round {checkpoint.round}"))
    return path


def check_stores(
    db_url: str, mlflow: str | None, tensorboard: Path | None, experiment: str
) -> None:
    """Refuse a missing extra or an unusable store before a run starts."""
    check_folder(tensorboard)
    LiveExport(db_url, mlflow=mlflow, tensorboard=tensorboard, experiment=experiment).check()


def mlflow_fails_fast() -> None:
    """A tracking server that is down fails the export in seconds, not after MLflow's
    minutes of retries (250 s to an address where nothing listens); the user's own
    settings of these stay."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


@contextlib.contextmanager
def live_export(
    db_url: str, mlflow: str | None, tensorboard: Path | None, experiment: str
) -> Iterator[LiveExport | None]:
    """A ``LiveExport`` to the stores given (None without any), checked before the run
    starts and closed when it ends, however it ends."""
    if mlflow is None and tensorboard is None:
        yield None
        return
    check_folder(tensorboard)
    mlflow_fails_fast()
    live = LiveExport(db_url, mlflow=mlflow, tensorboard=tensorboard, experiment=experiment)
    live.check()
    try:
        yield live
    finally:
        said = live.stopped is not None  # said when it stopped (``exporting``)
        with tempfile.TemporaryDirectory(prefix="flplatform-export-") as scratch:
            model = None
            if mlflow is not None and live.run_id is not None and live.stopped is None:
                try:
                    with LedgerRepository.open(db_url, create=False) as repository:
                        model = final_model(repository, live.run_id, Path(scratch) / "model")
                except Exception as exc:  # the run's own outcome is what the command says
                    live.stop(exc)
            live.close(model)
        if live.stopped is not None:
            if not said:
                say_stopped(live)
        elif live.run_id is not None:
            where = " and ".join(
                f"{name} ({target})"
                for name, target in (("MLflow", mlflow), ("TensorBoard", tensorboard))
                if target is not None
            )
            console.print(Text(f"Run {live.run_id} was logged to {where} as it trained."))


def exporting(show: ProgressCallback, live: LiveExport | None) -> ProgressCallback:
    """``show``, then each round to ``live`` as it is committed."""
    if live is None:
        return show

    def both(record: RunRecord | None, done: list[RoundRecord], failed: list[UpdateRecord]) -> None:
        show(record, done, failed)
        stopped = live.stopped
        live.update(record, done)
        if stopped is None and live.stopped is not None:
            say_stopped(live)

    return both


def say_stopped(live: LiveExport) -> None:
    console.print(
        Text(
            f"warning: the export to MLflow/TensorBoard stopped: {live.stopped}; the run goes "
            f"on (write it afterwards with flplatform history export {live.run_id} --force)",
            style="yellow",
        )
    )
