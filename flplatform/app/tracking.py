"""A run's history as experiment-tracking series: MLflow runs and TensorBoard event files.

:func:`run_series` reads one run of the ledger into a ``RunSeries``: its options as
parameters, and per round (the step) what the round tables show: the metrics the server
and sites reported, the training loss, bytes up and down, updates applied, rejected and
dropped, the round's wall time, the time since the run started and its simulated time,
and the staleness of the updates it applied; and per site, under ``site/<name>/``, the
bytes each site sent and received, the updates it had applied, their staleness and its
training loss. :func:`to_mlflow` and :func:`to_tensorboard` write series to a tracking
store. MLflow and TensorBoard are optional extras (``pip install 'flplatform[mlflow]'``,
``[tensorboard]``), imported only here, only when asked for; no Flower imports.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flplatform.core.errors import ConfigError, DataError
from storage import (
    RUN_FINISHED,
    UPDATE_APPLIED,
    LedgerRepository,
    RoundRecord,
    RunRecord,
    UpdateRecord,
)

# The tag an exported MLflow run carries: the ledger and run it came from, so that an
# export is found again (and replaced only when asked to).
MLFLOW_SOURCE_TAG = "flplatform.run"
# MLflow's limits per log_batch call (mlflow.utils.validation): 1,000 metrics, 100 params.
_MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_PARAM_LENGTH = 6000


@dataclass(frozen=True)
class Point:
    """One value of a series: at server round ``step``, written at ``wall_time`` (Unix s)."""

    key: str
    step: int
    value: float
    wall_time: float


@dataclass(frozen=True)
class RunSeries:
    """What a tracking store gets of one run: names, parameters, and the points."""

    run_id: int
    name: str
    source: str  # "<ledger id>:<run id>": the same run whatever URL the ledger is read by
    status: str
    params: dict[str, str]
    points: tuple[Point, ...]

    def metric_keys(self) -> list[str]:
        """The series' keys, each once, in the order first written."""
        return list(dict.fromkeys(p.key for p in self.points))

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of one key, by step."""
        return [(p.step, p.value) for p in self.points if p.key == key]


def run_series(repository: LedgerRepository, run_id: int) -> RunSeries:
    """Read run ``run_id`` of the ledger into series (see the module)."""
    run = repository.get_run(run_id)
    rounds = repository.list_rounds(run_id)
    updates = repository.list_updates(run_id)
    by_round: dict[int, list[UpdateRecord]] = defaultdict(list)
    for update in updates:
        by_round[update.round].append(update)
    points: list[Point] = []
    for record in rounds:
        points += _round_points(run, record, by_round.get(record.round, []))
    return RunSeries(
        run_id=run.id,
        name=run.name,
        source=f"{repository.ledger_id}:{run.id}",
        status=str(run.status),
        params=_params(run),
        points=tuple(points),
    )


def _params(run: RunRecord) -> dict[str, str]:
    """The run's options as strings, with what the ledger says of the run beside them."""
    params = {key: _text(value) for key, value in sorted(run.config.items())}
    params.update(
        {
            "strategy": run.strategy,
            "seed": str(run.seed),
            "rounds-planned": str(run.num_rounds_planned),
            "network": run.network or "none",
        }
    )
    return params


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MLFLOW_PARAM_LENGTH]


def _round_points(run: RunRecord, record: RoundRecord, updates: list[UpdateRecord]) -> list[Point]:
    at = record.finished_at.timestamp()
    step = record.round
    values: dict[str, float | None] = {
        key: value for key, value in record.metrics.items() if value is not None
    }
    applied = [u for u in updates if u.status == UPDATE_APPLIED]
    values.update(
        {
            "train_loss": record.train_loss,
            "bytes_up": record.bytes_up,
            "bytes_down": record.bytes_down,
            "eval_bytes_up": record.eval_bytes_up,
            "eval_bytes_down": record.eval_bytes_down,
            "applied": record.num_applied,
            "rejected": record.num_rejected,
            "dropped": record.num_dropped,
            "round_seconds": record.wall_seconds,
            "elapsed_seconds": at - run.created_at.timestamp(),
            "simulated_seconds": record.virtual_finished_at,
            "staleness_mean": _mean(u.staleness for u in applied),
            "staleness_max": max((u.staleness for u in applied), default=None),
        }
    )
    by_site: dict[str, list[UpdateRecord]] = defaultdict(list)
    for update in updates:
        by_site[update.site].append(update)
    for site, sent in sorted(by_site.items()):
        site_applied = [u for u in sent if u.status == UPDATE_APPLIED]
        values.update(
            {
                f"site/{site}/bytes_up": sum(u.bytes_up for u in sent),
                f"site/{site}/bytes_down": sum(u.bytes_down for u in sent),
                f"site/{site}/applied": len(site_applied),
                f"site/{site}/staleness": _mean(u.staleness for u in site_applied),
                f"site/{site}/train_loss": _mean(
                    u.train_loss for u in sent if u.train_loss is not None
                ),
            }
        )
    return [
        Point(key, step, float(value), at)
        for key, value in values.items()
        if value is not None and math.isfinite(float(value))
    ]


def _mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return sum(items) / len(items) if items else None


# ------------------------------------------------------------------------------ MLflow
def to_mlflow(
    runs: Sequence[RunSeries],
    tracking_uri: str,
    *,
    experiment: str = "flplatform",
    artifacts: Mapping[int, Path] | None = None,
    replace: bool = False,
) -> dict[int, str]:
    """Write each run to MLflow at ``tracking_uri`` as one MLflow run of ``experiment``.

    Parameters
    ----------
    runs : sequence of RunSeries
        The runs (``run_series``).
    tracking_uri : str
        An MLflow tracking URI (``sqlite:///mlflow.db``, ``http://host:5000``).
    experiment : str
        The MLflow experiment, created if missing.
    artifacts : mapping, optional
        Run id → a file to log as the MLflow run's artifact (the final model).
    replace : bool
        Replace an earlier export of the same run (found by its ``flplatform.run`` tag);
        without it, such a run is refused.

    Returns
    -------
    dict
        Run id → the MLflow run id it was written to.

    Raises
    ------
    ConfigError
        If MLflow is not installed, the store cannot be used, or a run was exported
        there before and ``replace`` is not set.
    """
    client, mlflow_error = _mlflow_client(tracking_uri)
    try:
        found = client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else client.create_experiment(experiment)
        )
        earlier = {
            series.run_id: _exported(client, experiment_id, series.source) for series in runs
        }
        again = [str(run_id) for run_id, ids in earlier.items() if ids]
        if again and not replace:
            raise ConfigError(
                f"run {', '.join(again)} was exported to experiment '{experiment}' at "
                f"{tracking_uri} before; pass --force to replace that export"
            )
        written: dict[int, str] = {}
        for series in runs:
            for old in earlier[series.run_id]:
                client.delete_run(old)
            written[series.run_id] = _write_mlflow_run(
                client, experiment_id, series, (artifacts or {}).get(series.run_id)
            )
        return written
    except mlflow_error as exc:
        raise ConfigError(f"MLflow at {tracking_uri}: {exc}") from None


def _mlflow_client(tracking_uri: str) -> tuple[Any, type[Exception]]:
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError(
            "exporting to MLflow needs MLflow: pip install 'flplatform[mlflow]'"
        ) from None
    # MLflow (and its Alembic) say at INFO that they set up a new store: not our user's news.
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return MlflowClient(tracking_uri=tracking_uri), MlflowException
    except MlflowException as exc:
        raise ConfigError(f"cannot use the MLflow store at {tracking_uri}: {exc}") from None


def _exported(client: Any, experiment_id: str, source: str) -> list[str]:
    """The MLflow runs of the experiment exported from ``source`` before."""
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{MLFLOW_SOURCE_TAG}` = '{source}'"
    )
    return [run.info.run_id for run in found]


def _write_mlflow_run(
    client: Any, experiment_id: str, series: RunSeries, artifact: Path | None
) -> str:
    from mlflow.entities import Metric, Param, RunTag

    tags = {MLFLOW_SOURCE_TAG: series.source, "flplatform.status": series.status}
    created = client.create_run(experiment_id, run_name=series.name, tags=tags)
    mlflow_run = created.info.run_id
    params = [Param(key, value) for key, value in series.params.items()]
    for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
        client.log_batch(mlflow_run, params=params[start : start + _MLFLOW_PARAMS_PER_BATCH])
    metrics = [Metric(p.key, p.value, int(p.wall_time * 1000), p.step) for p in series.points]
    for start in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
        client.log_batch(mlflow_run, metrics=metrics[start : start + _MLFLOW_METRICS_PER_BATCH])
    client.log_batch(mlflow_run, tags=[RunTag("flplatform.run_id", str(series.run_id))])
    if artifact is not None:
        client.log_artifact(mlflow_run, str(artifact))
    client.set_terminated(
        mlflow_run, status="FINISHED" if series.status == RUN_FINISHED else "FAILED"
    )
    return str(mlflow_run)


# -------------------------------------------------------------------------- TensorBoard
def tensorboard_directory(root: Path, series: RunSeries) -> Path:
    """Where a run's event files go under ``root``: one folder per run, ``<id>-<name>``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in series.name)
    return root / f"{series.run_id}-{safe}"


def to_tensorboard(
    runs: Sequence[RunSeries], root: Path, *, replace: bool = False
) -> dict[int, Path]:
    """Write each run's series as TensorBoard scalars under ``root/<id>-<name>/``, its
    options as a text summary (``options``); run id → its folder.

    Raises
    ------
    ConfigError
        If TensorBoard is not installed, or a run's folder exists and ``replace`` is not
        set (the folder is replaced when it is).
    DataError
        If the files cannot be written.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "exporting to TensorBoard needs TensorBoard: pip install 'flplatform[tensorboard]'"
        ) from None
    folders = {series.run_id: tensorboard_directory(root, series) for series in runs}
    there = [str(folder) for folder in folders.values() if folder.exists()]
    if there and not replace:
        raise ConfigError(f"{', '.join(there)} already exists; pass --force to replace it")
    try:
        for series in runs:
            folder = folders[series.run_id]
            if folder.exists():
                shutil.rmtree(folder)
            writer = SummaryWriter(log_dir=str(folder))
            try:
                for point in series.points:
                    writer.add_scalar(point.key, point.value, point.step, walltime=point.wall_time)
                table = "\n".join(f"| {k} | {v} |" for k, v in series.params.items())
                writer.add_text("options", "| option | value |\n|---|---|\n" + table, 0)
            finally:
                writer.close()
    except OSError as exc:
        raise DataError(f"cannot write TensorBoard files under {root}: {exc}") from None
    return folders
