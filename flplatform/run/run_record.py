"""One run's row in the ledger, as ``start`` keeps it: written first, then finished or failed.

``start`` opens the run (:func:`open_run`) before the first round, with the options that
shape it as its config; the engine commits each round through the run's ``sink``
(``flplatform.run.ledger.SqlLedger``); the run is marked finished, or failed with the reason, at
the end. A run that fails before it can start is recorded too (:func:`record_failed_start`).

``storage`` (SQLAlchemy) is imported only when a ledger is asked for.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flwr.app import MetricRecord

from flplatform.core.checks import is_number
from flplatform.core.errors import ConfigError, FLPlatformError, StorageError
from flplatform.engine import LedgerSink
from flplatform.network import Network
from flplatform.run.options import OPTION_NAMES, PlatformOptions, resolve_options
from flplatform.run.parts import network_label

if TYPE_CHECKING:
    from storage import LedgerRepository, RunEventRecord, RunRecord

log = logging.getLogger("flplatform")

# ``ledger`` values that name the default SQLite ledger ($FLPLATFORM_HOME/ledger.db).
DEFAULT_LEDGER = ("", "default")
# Options that shape how the run goes, recorded in the ledger's run config (kebab-case, as
# RunConfig spells them); where and under which name a run is recorded is not among them.
_RECORDED = tuple(
    n
    for n in OPTION_NAMES
    if n
    not in ("ledger", "name", "run_config", "tag", "checkpoint_dir", "resume_run", "launched_by")
)
# The recorded run config's key for how ``flplatform run`` launched the run
# (``PlatformOptions.launched_by``; read back by ``flplatform resume``).
LAUNCH_KEY = "flplatform-run"
_CONFIG_KEYS = {"num_rounds": "num-server-rounds", "timeout": "round-timeout"}


def open_run(
    options: PlatformOptions, overrides: Mapping[str, Any], strategy: str, *, codec: str = "none"
) -> LedgerRun | None:
    """The run's new row in the ledger the options name; None without a ledger.

    ``codec``: the strategy's upload codec, recorded as the run config's ``codec`` (a
    ServerApp that builds its strategy in code may leave the config's default "none").
    With ``resume_run``, the run it names, reopened, with the state to resume from.
    """
    if options.ledger is None:
        if options.resume_run is not None:
            raise ConfigError(
                f"resume_run={options.resume_run} needs the ledger the run is recorded in "
                f"(ledger=...)"
            )
        return None
    checkpointing = Checkpointing(
        every=options.checkpoint_every,
        keep=options.keep_checkpoints,
        directory=options.checkpoint_dir,
    )
    if options.resume_run is not None:
        return LedgerRun.reopen(
            options.ledger,
            options.resume_run,
            strategy=strategy,
            num_rounds=options.num_rounds,
            checkpointing=checkpointing,
        )
    return LedgerRun.open(
        options.ledger,
        name=options.name or strategy,
        strategy=strategy,
        seed=options.seed,
        config=_recorded_config(options, overrides, strategy, codec),
        num_rounds=options.num_rounds,
        tag=options.tag,
        network=network_label(options),
        checkpointing=checkpointing,
    )


@dataclass(frozen=True)
class Checkpointing:
    """How a run's checkpoints are kept (``start``'s ``checkpoint_*`` options)."""

    every: int = 5
    keep: int = 3
    directory: str | None = None


def refuse_finished(record: RunRecord) -> None:
    """``ConfigError`` for a run that finished: there is nothing to resume."""
    if record.status == "finished":
        raise ConfigError(f"run {record.id} finished; there is nothing to resume")


# The event ``flplatform server`` records on each run it deploys (detail: the sites, the
# address and the deployment's id): such a run's data is at its sites.
DEPLOYED_EVENT = "deployed"
# Set by ``flplatform server`` for the processes it starts, its ServerApp's among them: the
# deployment as JSON (its id, the sites, the address, and ``wait-timeout``: how long its
# sites are waited for, to connect and to answer). The run trains on the deployment's
# sites, not on this machine, and its ServerApp records it so (``DEPLOYED_EVENT``) with the
# run's own row, and again when it reopens the run.
DEPLOYMENT_ENV = "FLPLATFORM_DEPLOYMENT"
WAIT_TIMEOUT_KEY = "wait-timeout"


def deployment_detail(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The deployment ``DEPLOYMENT_ENV`` describes (``deployment``: its id, ``sites``,
    ``address``), or None outside one; ``ConfigError`` when it is not such JSON."""
    raw = (os.environ if environ is None else environ).get(DEPLOYMENT_ENV)
    if not raw:
        return None
    try:
        detail = json.loads(raw)
    except ValueError:
        detail = None
    wait = detail.get(WAIT_TIMEOUT_KEY) if isinstance(detail, dict) else None
    well_formed = (
        isinstance(detail, dict)
        and isinstance(detail.get("deployment"), str)
        and (wait is None or (is_number(wait) and wait > 0))
    )
    if not well_formed:
        raise ConfigError(
            f"{DEPLOYMENT_ENV} must be the JSON `flplatform server` writes (an object with "
            f"the deployment's id, and a {WAIT_TIMEOUT_KEY} > 0 in seconds if any), got "
            f"{raw!r:.80}"
        )
    return detail


def refuse_deployed(
    record: RunRecord, events: Sequence[RunEventRecord], *, on_deployment: str | None = None
) -> None:
    """``ConfigError`` for a resume in the wrong place.

    A run that trained on a deployment's sites resumes on them (``flplatform server
    --resume``): ``flplatform resume`` would start a local simulation, training on this
    machine's copies of their data and crediting the sites with it. A run that trained in
    a simulation does not resume on a deployment (``on_deployment``: its id, where the
    resume runs), nor a deployed run on another deployment (another CA). Checked by both
    commands before they start anything, and by ``LedgerRun.reopen`` for a resume asked
    for in any other way.
    """
    deployed = [e for e in events if e.kind == DEPLOYED_EVENT]
    if not deployed:
        if on_deployment:
            raise ConfigError(
                f"run {record.id} did not train on a deployment's sites (a simulation on "
                f"the machine that started it): resume it there with `flplatform resume "
                f"{record.id}`"
            )
        return
    if on_deployment:
        recorded = deployed[-1].detail.get("deployment")
        if isinstance(recorded, str) and recorded != on_deployment:
            raise ConfigError(
                f"run {record.id} trained on another deployment ({recorded}; this one is "
                f"{on_deployment}): resume it with that deployment's --certs"
            )
        return
    sites = deployed[-1].detail.get("sites")
    named = f" ({', '.join(map(str, sites))})" if isinstance(sites, list) and sites else ""
    raise ConfigError(
        f"run {record.id} trained on the sites of a deployment{named}: `flplatform resume` "
        "would train it on this machine, on data that belongs at the sites; resume it on "
        f"them with `flplatform server --resume {record.id}` and the deployment's --certs"
    )


def record_failed_start(exc: BaseException, *, strategy: str, **options: Any) -> None:
    """Record a run that failed before it could ``start`` (loading its data, say).

    The run is written as ``start`` would have written it (``FLPLATFORM_OPTIONS`` applied),
    then marked failed with ``exc``'s reason, so whoever follows the run by its tag learns
    why. Nothing is recorded without a ledger; a problem recording it is logged, not
    raised: ``exc`` is the news.

    Parameters
    ----------
    exc : BaseException
        Why the run failed.
    strategy : str
        The strategy's name in the ledger.
    **options
        ``start``'s keyword arguments that are plain data (``PlatformOptions``).
    """
    try:
        resolved, overrides = resolve_options(PlatformOptions(**options))
        run = open_run(resolved, overrides, strategy)
    except FLPlatformError as problem:
        log.error("could not record the failed run: %s", problem.reason)
        return
    if run is not None:
        run.fail(exc)


class LedgerRun:
    """One run's row in the ledger: created first, then finished or failed, said once.

    Parameters
    ----------
    repository : LedgerRepository
        The open ledger; closed when the run is finished or failed.
    run_id : int
        The run's id.
    run_key : str
        A stable id of the run that its sites key their kept state by (the same after a
        resume; the engine keeps it in its checkpoints).
    checkpointing : Checkpointing
        How its checkpoints are kept.
    resume_state : dict, optional
        The checkpoint to resume from (a reopened run); None for a new run.
    """

    def __init__(
        self,
        repository: LedgerRepository,
        run_id: int,
        *,
        run_key: str = "",
        checkpointing: Checkpointing | None = None,
        resume_state: dict[str, Any] | None = None,
    ) -> None:
        from flplatform.run.ledger import SqlLedger

        checkpointing = checkpointing or Checkpointing()
        self.repository = repository
        self.run_id = run_id
        self.run_key = run_key or uuid.uuid4().hex
        self.resume_state = resume_state
        self.ledger = SqlLedger(
            repository,
            run_id,
            checkpoint_dir=checkpointing.directory,
            checkpoint_every=checkpointing.every,
            keep_checkpoints=checkpointing.keep,
        )
        self.sink: LedgerSink = self.ledger

    @classmethod
    def open(
        cls,
        ledger: str,
        *,
        name: str,
        strategy: str,
        seed: int,
        config: Mapping[str, Any],
        num_rounds: int,
        tag: str | None = None,
        network: str | None = None,
        checkpointing: Checkpointing | None = None,
    ) -> LedgerRun:
        """Open the ledger ``ledger`` names and record a new, running run in it.

        Parameters
        ----------
        ledger : str
            A SQLAlchemy URL; ``""`` or ``"default"`` for the default SQLite ledger.
        name, strategy : str
            The run's name and its strategy's.
        seed : int
            The run's seed.
        config : mapping
            The run's configuration (JSON data).
        num_rounds : int
            Rounds the run intends to take.
        tag : str, optional
            A unique external id.
        network : str, optional
            The simulated network's name; None on the wall clock.
        checkpointing : Checkpointing, optional
            How its checkpoints are kept (default: ``Checkpointing()``).

        Returns
        -------
        LedgerRun
            The run, recorded as running.

        Raises
        ------
        StorageError
            If the ledger cannot be opened or the run not recorded (a taken tag, ...).
        """
        from flplatform.run.ledger import process_owner
        from storage import LedgerRepository

        deployed = deployment_detail()
        repository = LedgerRepository.open(None if ledger in DEFAULT_LEDGER else ledger)
        try:
            run_id = repository.create_run(
                name=name,
                strategy=strategy,
                seed=seed,
                config=dict(config),
                num_rounds_planned=num_rounds,
                tag=tag or None,
                network=network or None,
                owner=process_owner(),
                event=None if deployed is None else (DEPLOYED_EVENT, deployed),
            )
        except BaseException:
            repository.close()
            raise
        log.info("ledger: run %s in %s", run_id, repository.url)
        return cls(repository, run_id, run_key=tag or "", checkpointing=checkpointing)

    @classmethod
    def reopen(
        cls,
        ledger: str,
        run_id: int,
        *,
        strategy: str,
        num_rounds: int,
        checkpointing: Checkpointing | None = None,
    ) -> LedgerRun:
        """Reopen run ``run_id`` to resume it from its last checkpoint.

        The run must be one of ``strategy``'s, not finished, and have a checkpoint. It is
        marked running again (``flplatform resume`` may have done so already) with a
        "resumed" event, owned by this process.

        Raises
        ------
        NotFoundError
            If there is no such run.
        CheckpointError
            If it cannot be resumed (finished, another strategy, no checkpoint, the file
            missing or unreadable), saying why.
        """
        from flplatform.core.checkpoint import CheckpointError
        from flplatform.run.ledger import load_checkpoint, owner_alive, process_owner
        from storage import LedgerRepository

        deployed = deployment_detail()
        repository = LedgerRepository.open(None if ledger in DEFAULT_LEDGER else ledger)
        try:
            record = repository.get_run(run_id)
            refuse_finished(record)
            # Also for resume_run / resume-run given by hand, not only `flplatform resume`
            refuse_deployed(
                record,
                repository.list_events(run_id),
                on_deployment=None if deployed is None else deployed["deployment"],
            )
            if record.strategy != strategy:
                raise CheckpointError(
                    f"run {run_id} ran strategy {record.strategy!r}, not {strategy!r}; "
                    f"resume it with the options it was started with (flplatform resume)"
                )
            if record.num_rounds_planned != num_rounds:
                raise CheckpointError(
                    f"run {run_id} planned {record.num_rounds_planned} rounds, not {num_rounds}"
                )
            checkpoint, state = load_checkpoint(repository, run_id)
            if state.get("server_round") != checkpoint.round:
                raise CheckpointError(
                    f"checkpoint {checkpoint.path} holds round {state.get('server_round')!r}, "
                    f"but the ledger says round {checkpoint.round}"
                )
            # ``flplatform resume`` reopens the run before it starts this process (so that
            # it can follow it): then the owner is that command, alive.
            if record.status != "running" or owner_alive(record.owner) is False:
                repository.reopen_run(run_id, owner=process_owner())
            if deployed is not None:  # on the deployment's sites again
                repository.add_event(run_id, DEPLOYED_EVENT, deployed)
        except BaseException:
            repository.close()
            raise
        log.info(
            "ledger: resuming run %s in %s from round %s",
            run_id,
            repository.url,
            checkpoint.round,
        )
        return cls(
            repository,
            run_id,
            run_key=record.tag or "",
            checkpointing=checkpointing,
            resume_state=state,
        )

    def finish(
        self, *, final_metrics: MetricRecord | None, simulated_seconds: float | None
    ) -> None:
        """Mark the run finished with its final central metrics; close the ledger."""
        try:
            self.ledger.finish()
            self.repository.finish_run(
                self.run_id,
                status="finished",
                final_metrics=_numbers(final_metrics) if final_metrics else None,
                finished_at=time.time(),
                simulated_seconds=simulated_seconds,
            )
        finally:
            self.repository.close()

    def leave_to_owner(self) -> None:
        """Close the ledger and leave the run as it is: the command that owns it is
        stopping it, and marks it with why once every process is gone."""
        self.repository.close()

    def fail(self, exc: BaseException, *, simulated_seconds: float | None = None) -> None:
        """Mark the run failed with ``exc``'s reason; close the ledger.

        A ledger that cannot take the failure is logged, not raised: ``exc`` is the news.
        """
        reason = exc.reason if isinstance(exc, FLPlatformError) else f"{type(exc).__name__}: {exc}"
        try:
            self.repository.finish_run(
                self.run_id,
                status="failed",
                error=reason,
                finished_at=time.time(),
                simulated_seconds=simulated_seconds,
            )
        except StorageError as storage_error:
            log.error("could not record the failure of run %s: %s", self.run_id, storage_error)
        finally:
            self.repository.close()


def _recorded_config(
    options: PlatformOptions, overrides: Mapping[str, Any], strategy: str, codec: str
) -> dict[str, Any]:
    """The run config to record: the caller's (with the overrides written in), or the
    options; and the strategy's codec where it names none."""
    if options.run_config is None:
        recorded: dict[str, Any] = {"strategy": strategy}
        chosen = {n: getattr(options, n) for n in _RECORDED}
    else:
        recorded = dict(options.run_config)
        chosen = {n: v for n, v in overrides.items() if n in _RECORDED}
    if codec != "none":  # what the sites were asked for, whatever the config's default
        recorded["codec"] = codec
    for option, value in chosen.items():
        recorded[_CONFIG_KEYS.get(option, option.replace("_", "-"))] = _config_value(value)
    if "staleness_bound" in chosen and options.staleness_bound is None:
        recorded["staleness-bound"] = -1  # RunConfig's "no bound"
    if options.launched_by is not None:
        recorded[LAUNCH_KEY] = dict(options.launched_by)
    return recorded


def _config_value(value: Any) -> Any:
    """An option as the run config spells it ("" for none, a network by its name)."""
    if isinstance(value, Network):
        return value.name
    return "" if value is None else value


def _numbers(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
