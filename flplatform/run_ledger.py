"""One run's row in the ledger, as ``start`` keeps it: written first, then finished or failed.

``start`` opens the run (:func:`open_run`) before the first round, with the options that
shape it as its config; the engine commits each round through the run's ``sink``
(``flplatform.ledger.SqlLedger``); the run is marked finished, or failed with the reason, at
the end. A run that fails before it can start is recorded too (:func:`record_failed_start`).

``storage`` (SQLAlchemy) is imported only when a ledger is asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import MetricRecord

from flplatform.engine import LedgerSink
from flplatform.errors import FLPlatformError, StorageError
from flplatform.network import Network
from flplatform.start_options import OPTION_NAMES, PlatformOptions, resolve_options
from flplatform.start_parts import network_label

if TYPE_CHECKING:
    from storage import LedgerRepository

log = logging.getLogger("flplatform")

# ``ledger`` values that name the default SQLite ledger ($FLPLATFORM_HOME/ledger.db).
DEFAULT_LEDGER = ("", "default")
# Options that shape how the run goes, recorded in the ledger's run config (kebab-case, as
# RunConfig spells them); where and under which name a run is recorded is not among them.
_RECORDED = tuple(n for n in OPTION_NAMES if n not in ("ledger", "name", "run_config", "tag"))
_CONFIG_KEYS = {"num_rounds": "num-server-rounds", "timeout": "round-timeout"}


def open_run(
    options: PlatformOptions, overrides: Mapping[str, Any], strategy: str
) -> LedgerRun | None:
    """The run's new row in the ledger the options name; None without a ledger."""
    if options.ledger is None:
        return None
    return LedgerRun.open(
        options.ledger,
        name=options.name or strategy,
        strategy=strategy,
        seed=options.seed,
        config=_recorded_config(options, overrides, strategy),
        num_rounds=options.num_rounds,
        tag=options.tag,
        network=network_label(options),
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
    """

    def __init__(self, repository: LedgerRepository, run_id: int) -> None:
        from flplatform.ledger import SqlLedger

        self.repository = repository
        self.run_id = run_id
        self.sink: LedgerSink = SqlLedger(repository, run_id)

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

        Returns
        -------
        LedgerRun
            The run, recorded as running.

        Raises
        ------
        StorageError
            If the ledger cannot be opened or the run not recorded (a taken tag, ...).
        """
        from storage import LedgerRepository

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
            )
        except BaseException:
            repository.close()
            raise
        log.info("ledger: run %s in %s", run_id, repository.url)
        return cls(repository, run_id)

    def finish(
        self, *, final_metrics: MetricRecord | None, simulated_seconds: float | None
    ) -> None:
        """Mark the run finished with its final central metrics; close the ledger."""
        try:
            self.repository.finish_run(
                self.run_id,
                status="finished",
                final_metrics=_numbers(final_metrics) if final_metrics else None,
                finished_at=time.time(),
                simulated_seconds=simulated_seconds,
            )
        finally:
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
    options: PlatformOptions, overrides: Mapping[str, Any], strategy: str
) -> dict[str, Any]:
    """The run config to record: the caller's (with the overrides written in), or the options."""
    if options.run_config is None:
        recorded: dict[str, Any] = {"strategy": strategy}
        chosen = {n: getattr(options, n) for n in _RECORDED}
    else:
        recorded = dict(options.run_config)
        chosen = {n: v for n, v in overrides.items() if n in _RECORDED}
    for option, value in chosen.items():
        recorded[_CONFIG_KEYS.get(option, option.replace("_", "-"))] = _config_value(value)
    if "staleness_bound" in chosen and options.staleness_bound is None:
        recorded["staleness-bound"] = -1  # RunConfig's "no bound"
    return recorded


def _config_value(value: Any) -> Any:
    """An option as the run config spells it ("" for none, a network by its name)."""
    if isinstance(value, Network):
        return value.name
    return "" if value is None else value


def _numbers(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
