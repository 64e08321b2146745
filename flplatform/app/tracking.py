"""A run's history as experiment-tracking series: MLflow runs and TensorBoard event files.

:func:`run_series` reads one run of the ledger into a ``RunSeries``: its options as
parameters (not where its files were: ``_NOT_PARAMETERS``), and per round (the step)
what the round tables show: the metrics the server and sites reported, the training
loss, bytes up and down, updates applied, rejected and dropped, the round's wall time,
the time since the run started and its simulated time, and the staleness of the updates
it applied; and per site, under ``site/<name>/``, the bytes each site sent and received,
the updates it had applied, their staleness and its training loss. :func:`to_mlflow` and
:func:`to_tensorboard` write series to a tracking store. MLflow and TensorBoard are
optional extras (``pip install 'flplatform[mlflow]'``, ``[tensorboard]``), imported only
here, only when asked for; no Flower imports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import shutil
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
    started_at: float = 0.0  # the run's creation (Unix s)
    ended_at: float | None = None  # its end, if it ended

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
    return _series(repository, run, tuple(points))


def _series(repository: LedgerRepository, run: RunRecord, points: tuple[Point, ...]) -> RunSeries:
    """The run's names, status, parameters and times, with ``points``."""
    return RunSeries(
        run_id=run.id,
        name=run.name,
        source=f"{repository.ledger_id}:{run.id}",
        status=str(run.status),
        params=_params(run),
        points=points,
        started_at=run.created_at.timestamp(),
        ended_at=run.finished_at.timestamp() if run.finished_at else None,
    )


# Options that say where a run's files were, not how it trained: the ledger's URL (its host
# and path; only the password is masked), the checkpoint folder, and how `flplatform run`
# launched it (the app's and the working directory; the options it lists are parameters
# of their own). Parameters are for comparing runs; these would only show whoever reads the
# tracking store the layout of the machines, and differ between runs that trained alike.
# ("flplatform-run" is flplatform.run.run_record.LAUNCH_KEY, spelled out: importing that
# module would import Flower.)
_NOT_PARAMETERS = frozenset({"db", "checkpoint-dir", "flplatform-run"})


def _params(run: RunRecord) -> dict[str, str]:
    """The run's options as strings (less those of ``_NOT_PARAMETERS``), with what the
    ledger says of the run beside them."""
    params = {
        key: _text(value) for key, value in sorted(run.config.items()) if key not in _NOT_PARAMETERS
    }
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
    applied = [u for u in updates if u.status == UPDATE_APPLIED]
    platform: dict[str, float | None] = {
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
    # The round's own metrics (the server's and sites' evaluation, the app's); one named
    # like a series of the platform's is kept beside it as metrics/<name>.
    # (judged as MLflow names them too: "/bytes_up" and "round@seconds" are its bytes_up
    # and round_seconds)
    ours = {mlflow_name(key) for key in platform}
    values: dict[str, float | None] = {
        (
            f"metrics/{key}"
            if key in platform or mlflow_name(key) in ours or mlflow_name(key).startswith("site/")
            else key
        ): value
        for key, value in record.metrics.items()
        if value is not None
    }
    values.update(platform)
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
# What MLflow accepts in a metric or parameter name (mlflow.utils.validation, the portable
# set: no colons; its \w is Unicode's, so that sites named 東京 and 大阪 keep two series),
# at most _MLFLOW_KEY_LENGTH characters, and no name that a path normalisation would change
# (a//b, a/./b, /a).
_MLFLOW_NAME_CHARACTERS = re.compile(r"[^/\w.\- ]")
_MLFLOW_KEY_LENGTH = 250
_DIGEST_LENGTH = 8


def mlflow_name(key: str) -> str:
    """``key`` as MLflow accepts it: other characters become ``_`` (an app's metric
    ``acc@1`` is ``acc_1``), empty, ``.`` and ``..`` path parts are left out. A name over
    250 characters keeps its last part (``bytes_up`` of ``site/<a long name>/bytes_up``)
    and the start of the rest, marked with a digest of the whole key: two long keys that
    differ only past the cut stay two names."""
    parts = _MLFLOW_NAME_CHARACTERS.sub("_", key).split("/")
    kept = [part for part in parts if part not in ("", ".", "..")]
    name = "/".join(kept)
    if len(name) <= _MLFLOW_KEY_LENGTH:
        return name or "_"
    digest = _digest(key)
    last = kept[-1] if len(kept) > 1 and len(kept[-1]) < _MLFLOW_KEY_LENGTH // 2 else ""
    room = _MLFLOW_KEY_LENGTH - len(digest) - 1 - (len(last) + 1 if last else 0)
    head = name[: len(name) - len(last) - 1] if last else name
    shortened = f"{head[:room].rstrip('/')}-{digest}"
    return f"{shortened}/{last}" if last else shortened


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_LENGTH]


class _MlflowNames:
    """Each key's MLflow name, one name per key within a run: a key whose name another key
    took first (``top@k`` and ``top#k`` are both ``top_k``) gets the name with a digest of
    its own added, so that neither hides the other."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = mlflow_name(key)
            if name in self._taken:
                suffix = f"-{_digest(key)}"
                name = name[: _MLFLOW_KEY_LENGTH - len(suffix)].rstrip("/") + suffix
            self._names[key] = name
            self._taken.add(name)
        return name


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: ``mlruns`` beside the
    database file. (MLflow's own default is ``./mlruns`` in whatever directory the command
    ran in: a model would land in the user's working tree.) None for other stores: the
    tracking server decides."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or tracking_uri[len(prefix) :] in ("", ":memory:"):
        return None
    database = Path(tracking_uri[len(prefix) :]).expanduser().resolve()
    return (database.parent / "mlruns").as_uri()


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class MlflowRun:
    """One run's MLflow run: opened with its parameters, written point by point, closed
    with its status (and the final model as an artifact)."""

    def __init__(self, store: _MlflowStore, series: RunSeries) -> None:
        from mlflow.entities import Param

        self.store = store
        self.name = _MlflowNames()  # metric and parameter names share MLflow's namespace
        tags = {MLFLOW_SOURCE_TAG: series.source, "flplatform.run_id": str(series.run_id)}
        with store.errors():
            created = store.client.create_run(
                store.experiment_id,
                run_name=series.name,
                tags=tags,
                start_time=_ms(series.started_at) if series.started_at else None,
            )
        self.id = str(created.info.run_id)
        params = [Param(self.name(key), value) for key, value in series.params.items()]
        try:
            with store.errors():
                for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
                    store.client.log_batch(
                        self.id, params=params[start : start + _MLFLOW_PARAMS_PER_BATCH]
                    )
        except ConfigError:  # no half-made run left behind (it would count as exported)
            with contextlib.suppress(Exception):  # the store may be what failed
                store.client.delete_run(self.id)
            raise

    def write(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(self.name(p.key), p.value, _ms(p.wall_time), p.step) for p in points]
        with self.store.errors():
            for start in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
                self.store.client.log_batch(
                    self.id, metrics=metrics[start : start + _MLFLOW_METRICS_PER_BATCH]
                )

    def close(
        self, status: str, artifact: Path | None = None, ended_at: float | None = None
    ) -> None:
        """End the MLflow run: FINISHED for a finished run, else FAILED (at ``ended_at``,
        Unix s; now when None)."""
        with self.store.errors():
            if artifact is not None:
                self.store.client.log_artifact(self.id, str(artifact))
            self.store.client.set_tag(self.id, "flplatform.status", status)
            finished = "FINISHED" if status == RUN_FINISHED else "FAILED"
            end = _ms(ended_at) if ended_at is not None else None
            self.store.client.set_terminated(self.id, status=finished, end_time=end)


class _MlflowStore:
    """An MLflow tracking store and the experiment runs go to (created if missing)."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        try:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                "exporting to MLflow needs MLflow: pip install 'flplatform[mlflow]'"
            ) from None
        # MLflow (and its Alembic) say at INFO that they set up a new store: not news.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri = tracking_uri
        self._error = MlflowException
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri)
        except MlflowException as exc:
            raise ConfigError(f"cannot use the MLflow store at {tracking_uri}: {exc}") from None
        with self.errors():
            found = self.client.get_experiment_by_name(experiment)
            if found is not None and found.lifecycle_stage == "deleted":
                raise ConfigError(
                    f"the MLflow experiment '{experiment}' at {tracking_uri} was deleted: "
                    "restore it (mlflow experiments restore) or choose another --experiment"
                )
            self.experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(
                    experiment, artifact_location=artifact_location(tracking_uri)
                )
            )

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """MLflow's errors as ours: a ``ConfigError`` naming the store."""
        try:
            yield
        except self._error as exc:
            raise ConfigError(f"MLflow at {self.uri}: {exc}") from None

    def exported(self, source: str) -> list[str]:
        """The MLflow runs of the experiment exported from ``source`` before."""
        with self.errors():
            found = self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.`{MLFLOW_SOURCE_TAG}` = '{source}'"
            )
        return [run.info.run_id for run in found]


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
    store = _MlflowStore(tracking_uri, experiment)
    earlier = {series.run_id: store.exported(series.source) for series in runs}
    again = [str(run_id) for run_id, ids in earlier.items() if ids]
    if again and not replace:
        raise ConfigError(
            f"run {', '.join(again)} was exported to experiment '{experiment}' at "
            f"{tracking_uri} before; pass --force to replace that export"
        )
    written: dict[int, str] = {}
    for series in runs:
        # the new export whole first: one that fails is removed, and the earlier one stays
        run = MlflowRun(store, series)
        try:
            run.write(series.points)
            run.close(series.status, (artifacts or {}).get(series.run_id), series.ended_at)
        except ConfigError:
            with contextlib.suppress(Exception):  # the store may be what failed
                store.client.delete_run(run.id)
            raise
        with store.errors():
            for old in earlier[series.run_id]:
                store.client.delete_run(old)
        written[series.run_id] = run.id
    return written


# -------------------------------------------------------------------------- TensorBoard
def tensorboard_directory(root: Path, run_id: int, name: str) -> Path:
    """Where a run's event files go under ``root``: one folder per run, ``<id>-<name>``
    (characters other than letters, digits and ``-_.`` made ``_``)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    if len(safe.encode()) > _FOLDER_NAME_BYTES:  # a file name holds 255 bytes
        kept = safe.encode()[:_FOLDER_NAME_BYTES].decode(errors="ignore")
        safe = f"{kept}-{_digest(name)}"
    return root / f"{run_id}-{safe}"


# A run's name in its TensorBoard folder, in bytes, at most: with the id, the digest and
# dashes the folder's name stays within the 255 bytes a file system allows.
_FOLDER_NAME_BYTES = 200


def _summary_writer() -> Any:
    """TensorBoard's writer (through PyTorch), or a ``ConfigError`` naming the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "exporting to TensorBoard needs TensorBoard: pip install 'flplatform[tensorboard]'"
        ) from None
    return SummaryWriter


# In each run's TensorBoard folder: the ledger and run it holds ("<ledger id>:<run id>"), so
# that a folder is replaced only by an export of the same run.
TENSORBOARD_SOURCE_FILE = "flplatform-run.txt"


def _check_replaceable(folder: Path, series: RunSeries) -> None:
    """Refuse to replace a folder that holds another ledger's run (same id and name)."""
    try:
        held = (folder / TENSORBOARD_SOURCE_FILE).read_text().strip()
    except OSError:
        held = None
    if held != series.source:
        what = f"another run ({held})" if held else "files flplatform did not write"
        raise ConfigError(f"{folder} holds {what}; give another --tensorboard folder")


class TensorBoardRun:
    """One run's TensorBoard folder: its options as a text summary (``options``), then
    scalars point by point."""

    def __init__(self, folder: Path, series: RunSeries) -> None:
        SummaryWriter = _summary_writer()  # noqa: N806 (a class)
        self.folder = folder
        with self.errors():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / TENSORBOARD_SOURCE_FILE).write_text(series.source + "\n")
            self.writer = SummaryWriter(log_dir=str(folder))
            table = "\n".join(f"| {k} | {v} |" for k, v in series.params.items())
            self.writer.add_text("options", "| option | value |\n|---|---|\n" + table, 0)

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise DataError(f"cannot write TensorBoard files in {self.folder}: {exc}") from None

    def write(self, points: Sequence[Point]) -> None:
        with self.errors():
            for point in points:
                self.writer.add_scalar(point.key, point.value, point.step, walltime=point.wall_time)
            self.writer.flush()

    def close(
        self, status: str, artifact: Path | None = None, ended_at: float | None = None
    ) -> None:
        del status, artifact, ended_at  # TensorBoard keeps scalars only
        with self.errors():
            self.writer.close()


def check_tensorboard_free(runs: Sequence[RunSeries], root: Path) -> None:
    """Refuse (``ConfigError``) runs whose TensorBoard folder under ``root`` exists."""
    there = [
        str(folder)
        for folder in (tensorboard_directory(root, r.run_id, r.name) for r in runs)
        if folder.exists()
    ]
    if there:
        raise ConfigError(f"{', '.join(there)} already exists; pass --force to replace it")


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
    if not replace:
        check_tensorboard_free(runs, root)
    folders = {
        series.run_id: tensorboard_directory(root, series.run_id, series.name) for series in runs
    }
    for series in runs:
        folder = folders[series.run_id]
        if folder.exists():
            _check_replaceable(folder, series)
            try:
                shutil.rmtree(folder)
            except OSError as exc:
                raise DataError(f"cannot replace {folder}: {exc}") from None
        run = TensorBoardRun(folder, series)
        run.write(series.points)
        run.close(series.status)
    return folders


# --------------------------------------------------------------------------------- live
class LiveExport:
    """A run's rounds to MLflow and TensorBoard as the ledger commits them.

    The command following a run calls :meth:`update` with the run and its rounds so far
    (its progress callback) and :meth:`close` when it ends. An export that fails stops,
    saying why once (``stopped``); the run goes on, and ``flplatform history export``
    can write it afterwards.
    """

    def __init__(
        self,
        db_url: str,
        *,
        mlflow: str | None = None,
        tensorboard: Path | None = None,
        experiment: str = "flplatform",
    ) -> None:
        self.db_url = db_url
        self.mlflow, self.tensorboard, self.experiment = mlflow, tensorboard, experiment
        self.runs: list[MlflowRun | TensorBoardRun] = []
        self.run_id: int | None = None
        self.written = 0  # rounds written
        self.stopped: str | None = None
        # a resumed run's earlier MLflow export, deleted once this one has ended
        self._earlier: tuple[_MlflowStore | None, list[str]] = (None, [])

    def check(self) -> None:
        """Refuse, before the run starts, an extra that is missing or a store that cannot
        be used (``ConfigError``)."""
        if self.mlflow is not None:
            _MlflowStore(self.mlflow, self.experiment)
        if self.tensorboard is not None:
            _summary_writer()

    def update(self, record: RunRecord | None, done: Sequence[RoundRecord]) -> None:
        """Write the rounds of ``done`` not written yet (opening the exports first)."""
        if record is None or self.stopped is not None:
            return
        if self.run_id is not None and not any(r.round > self.written for r in done):
            return  # nothing new: the ledger is not read on every poll
        try:
            with LedgerRepository.open(self.db_url, create=False) as repository:
                if self.run_id is None:
                    self._open(repository, record)
                points: list[Point] = []
                for finished in done:
                    if finished.round > self.written:
                        updates = repository.list_updates(record.id, round=finished.round)
                        points += _round_points(record, finished, updates)
                        self.written = finished.round
            for run in self.runs:
                run.write(points)
        except Exception as exc:  # an export must never end the run it follows
            self.stop(exc)

    def close(self, artifact: Path | None = None) -> None:
        """Write the rounds committed since the last update, then end the exports with
        the run's status as the ledger has it (and the final model, for MLflow). An
        export that stopped is ended too, as failed, so that no MLflow run stays RUNNING
        and no event file open."""
        if self.run_id is None:
            return
        status, ended_at = "failed", None
        try:
            with LedgerRepository.open(self.db_url, create=False) as repository:
                record = repository.get_run(self.run_id)
                rounds = repository.list_rounds(self.run_id)
            self.update(record, rounds)
            status = str(record.status)
            ended_at = record.finished_at.timestamp() if record.finished_at else None
        except Exception as exc:  # as in update
            self.stop(exc)
        if self.stopped is not None:
            status, artifact = "failed", None
        for run in self.runs:
            try:
                run.close(status, artifact, ended_at)
            except Exception as exc:  # as in update
                self.stop(exc)
        self.runs = []
        store, earlier = self._earlier
        if self.stopped is None and store is not None:
            try:
                with store.errors():
                    for old in earlier:  # replaced by this one, which holds every round
                        store.client.delete_run(old)
            except Exception as exc:  # as in update
                self.stop(exc)

    def _open(self, repository: LedgerRepository, record: RunRecord) -> None:
        """Open the exports. A resumed run's export before it stopped (this run's, by its
        source) is replaced: this one writes every round again, its earlier ones first
        (the MLflow run is deleted once this one has ended; the TensorBoard folder now)."""
        self.run_id = record.id
        header = _series(repository, record, ())
        if self.mlflow is not None:
            store = _MlflowStore(self.mlflow, self.experiment)
            self._earlier = (store, store.exported(header.source))
            self.runs.append(MlflowRun(store, header))
        if self.tensorboard is not None:
            folder = tensorboard_directory(self.tensorboard, header.run_id, header.name)
            if folder.exists():
                _check_replaceable(folder, header)  # another ledger's run: refused
                try:
                    shutil.rmtree(folder)
                except OSError as exc:
                    raise DataError(f"cannot replace {folder}: {exc}") from None
            self.runs.append(TensorBoardRun(folder, header))

    def stop(self, exc: Exception) -> None:
        """Stop exporting, keeping why (said once by the command)."""
        self.stopped = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
