"""``flplatform.start``: the one call of a user's ServerApp that adds the platform's parts.

Where a Flower ServerApp calls ``strategy.start(grid, arrays, num_rounds=...)``, it calls
``flplatform.start(strategy, grid, arrays, num_rounds=..., sync="k-async", network="world",
ledger="default")`` instead and gets, on top of Flower's ``Result``:

* a synchrony mode (``flplatform.engine.synchrony``): sync, K-sync, K-async, buffered, ...;
* a simulated network on a virtual clock (``flplatform.network``), or the wall clock;
* the ledger: the run's row is written first, each round is committed as it finishes, and
  the run is marked finished, or failed with the reason, at the end.

Any strategy runs: flplatform's own (each an ``EngineStrategy``) as they are,
Flower's own (FedAvg, FedProx, FedAdam, ...) wrapped in
``strategies.flower_adapter.FlowerStrategyAdapter``, fully synchronously. A strategy
chooses the policy it runs the requested mode with (``EngineStrategy.engine_policy``).

Command-line overrides: ``flplatform run APP_DIR --network world --sync k-async`` hands its
options to the ServerApp process in the environment variable ``FLPLATFORM_OPTIONS``, a JSON
object of ``start()`` keyword names and values (build it with ``options_environment``).
They override the keyword arguments the ServerApp's code passed; an unknown name or a bad
value is a ``ConfigError`` naming it.

Importing the package stays light: ``flplatform.start`` is loaded on first use (the
package's ``__getattr__``), and this module, once loaded, is itself callable, so that
``import flplatform; flplatform.start(...)`` works whichever way it was first imported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flplatform.engine import (
    AggregationPolicy,
    Clock,
    EngineStrategy,
    LedgerSink,
    RoundEngine,
    RoundSummary,
    Synchrony,
    VirtualClock,
    WallClock,
)
from flplatform.engine.synchrony import SYNC_MODES
from flplatform.errors import ConfigError, FLPlatformError, StorageError
from flplatform.network import Network, load_network

if TYPE_CHECKING:  # storage (SQLAlchemy) is imported only when a ledger is asked for
    from storage import LedgerRepository

log = logging.getLogger("flplatform")

# The environment variable through which ``flplatform run`` passes its options.
OPTIONS_ENV = "FLPLATFORM_OPTIONS"
# ``ledger`` values that name the default SQLite ledger ($FLPLATFORM_HOME/ledger.db).
DEFAULT_LEDGER = ("", "default")
# The engine's hooks a strategy of its own has (Flower's strategies lack them, and are wrapped).
STREAMING_HOOKS = ("begin_aggregation", "accumulate", "finish_aggregation")


@dataclass(frozen=True)
class PlatformOptions:
    """The keyword arguments of ``start`` that are plain data (and may come from the CLI).

    Their meaning is documented on ``start``; the defaults are its defaults.
    """

    num_rounds: int = 3
    timeout: float = 3600.0
    sync: str = "sync"
    k: int = 2
    staleness_bound: int | None = None
    staleness_weighting: str | None = None
    staleness_step_c: float = 1.0
    adasync: bool = False
    concurrency: int = 0
    network: str | Network | None = None
    compute_model: str = ""
    step_seconds: float = 0.0
    seed: int = 0
    ledger: str | None = None
    name: str | None = None
    run_config: Mapping[str, Any] | None = None
    tag: str | None = None
    required_sites: int = 0
    max_failed_rounds: int = 3


OPTION_NAMES = tuple(f.name for f in fields(PlatformOptions))
# Options that shape how the run goes, recorded in the ledger's run config (kebab-case, as
# RunConfig spells them); where and under which name a run is recorded is not among them.
_RECORDED = tuple(n for n in OPTION_NAMES if n not in ("ledger", "name", "run_config", "tag"))
_CONFIG_KEYS = {"num_rounds": "num-server-rounds", "timeout": "round-timeout"}


# =================================================================== the call
def start(
    strategy: Strategy | EngineStrategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int = 3,
    timeout: float = 3600.0,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    sync: str = "sync",
    k: int = 2,
    staleness_bound: int | None = None,
    staleness_weighting: str | None = None,
    staleness_step_c: float = 1.0,
    adasync: bool = False,
    concurrency: int = 0,
    network: str | Network | None = None,
    compute_model: str = "",
    step_seconds: float = 0.0,
    seed: int = 0,
    ledger: str | None = None,
    name: str | None = None,
    run_config: Mapping[str, Any] | None = None,
    tag: str | None = None,
    required_sites: int = 0,
    max_failed_rounds: int = 3,
    on_round: Callable[[RoundSummary], None] | None = None,
) -> Result:
    """Run ``strategy`` over ``grid`` for ``num_rounds`` rounds with the platform's parts.

    Options in ``FLPLATFORM_OPTIONS`` (set by ``flplatform run``) override the keyword
    arguments given here.

    Parameters
    ----------
    strategy : Strategy or EngineStrategy
        flplatform's strategy (``strategies.local_sgd.LocalSGDAveraging``, ...) or any of
        Flower's (``FedAvg``, ``FedProx``, ...; run fully synchronously).
    grid : Grid
        The ServerApp's Grid.
    initial_arrays : ArrayRecord
        The initial global model.
    num_rounds : int
        Server steps (rounds) to take, ≥ 1.
    timeout : float
        Seconds a site may take to answer one message, > 0.
    train_config, evaluate_config : ConfigRecord, optional
        Sent to the sites with every training / evaluation message.
    evaluate_fn : callable, optional
        Central evaluation ``(round, arrays) -> MetricRecord | None``, called before the
        first round and after each one, as in Flower's ``start``.
    sync : str
        Synchrony mode, one of ``SYNC_MODES``; Flower's strategies and flplatform's
        delayed and sketched strategies run ``sync`` only.
    k : int
        K of the K modes (``k-sync``, ``k-async``, ``buffered``, ...).
    staleness_bound : int, optional
        s of stale-synchronous parallel (async modes); None for no bound.
    staleness_weighting : {"none", "sqrt", "step"}, optional
        Staleness weighting of the async modes; None for the mode's default.
    staleness_step_c : float
        C of the ``step`` weighting.
    adasync : bool
        Grow K as the training loss falls (K modes).
    concurrency : int
        Most sites training at once in the async modes; 0 for all.
    network : str or Network, optional
        A simulated network (a preset such as ``world``, a profile ``.toml`` path, or a
        ``Network``): rounds run on its virtual clock. None: the wall clock.
    compute_model : str
        Override every site's compute model (a network named by preset or file only).
    step_seconds : float
        Override every site's mean seconds per local step (0: keep the profiles').
    seed : int
        Seeds the policy's sampling and the network's speeds and compute times.
    ledger : str, optional
        A SQLAlchemy URL of the ledger to record the run in; ``""`` or ``"default"`` for
        ``$FLPLATFORM_HOME/ledger.db``; None to record nothing.
    name : str, optional
        The run's name in the ledger (default: the strategy's).
    run_config : mapping, optional
        Recorded as the run's config (default: these options); options overridden by
        ``FLPLATFORM_OPTIONS`` are written into it.
    tag : str, optional
        A unique external id of the run in the ledger (another process finds it by it).
    required_sites : int
        Nodes to wait for before the first round (0: start with those connected).
    max_failed_rounds : int
        Stop after this many rounds in a row in which every reply failed the same way
        (``NoProgress``); 0 never stops.
    on_round : callable, optional
        Called with every finished round's ``RoundSummary`` (each is also logged).

    Returns
    -------
    Result
        Flower's result: the final model and every round's metrics.

    Raises
    ------
    ConfigError
        For a bad option (here or in ``FLPLATFORM_OPTIONS``), a mode the strategy cannot
        run, or an object that is not a strategy.
    StorageError
        If the ledger cannot be opened or written.
    RunFailed
        If the run could not start (too few sites) or stopped early (``NoProgress``).
    """
    given = PlatformOptions(
        num_rounds=num_rounds,
        timeout=timeout,
        sync=sync,
        k=k,
        staleness_bound=staleness_bound,
        staleness_weighting=staleness_weighting,
        staleness_step_c=staleness_step_c,
        adasync=adasync,
        concurrency=concurrency,
        network=network,
        compute_model=compute_model,
        step_seconds=step_seconds,
        seed=seed,
        ledger=ledger,
        name=name,
        run_config=run_config,
        tag=tag,
        required_sites=required_sites,
        max_failed_rounds=max_failed_rounds,
    )
    options, overrides = _resolve(given)
    engine_strategy = as_engine_strategy(strategy)
    label = strategy_name(engine_strategy)
    policy = choose_policy(engine_strategy, options)
    clock = _clock(options)
    network_label = _network_label(options)
    run = _open_run(options, overrides, label)
    _log_start(engine_strategy, label, policy, network_label, options.num_rounds)
    engine: RoundEngine | None = None
    try:
        engine = RoundEngine(
            grid,
            engine_strategy,
            policy=policy,
            clock=clock,
            ledger=run.sink if run is not None else None,
            round_timeout=options.timeout,
            required_sites=options.required_sites,
            on_round=_round_reporter(on_round),
            max_failed_rounds=options.max_failed_rounds,
        )
        result = engine.run(
            initial_arrays,
            num_rounds=options.num_rounds,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            # As Flower's start: every round asks the strategy for evaluation messages (a
            # strategy that evaluates nothing sends none).
            federated_evaluation=True,
        )
    except BaseException as exc:
        if run is not None:
            run.fail(exc, simulated_seconds=engine.simulated_seconds if engine else None)
        raise
    if run is not None:
        final = result.evaluate_metrics_serverapp.get(options.num_rounds)
        run.finish(final_metrics=final, simulated_seconds=engine.simulated_seconds)
    return result


# ============================================================ strategies
class PlatformStart:
    """Flower's ``start`` for the platform's strategies: it runs ``flplatform.start``.

    A ServerApp written for Flower (``strategy.start(grid, arrays, num_rounds=...)``) runs
    under the round engine, with each strategy's own synchrony (its ``engine_policy``) and no
    ledger; ``FLPLATFORM_OPTIONS`` (``flplatform run``) may still add a mode, a network or a
    ledger. Call ``flplatform.start`` to choose them in code. Listed before Flower's
    ``Strategy`` among a strategy's bases, so that this ``start`` is the one called.
    """

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``start`` signature; see the class."""
        return start(
            as_engine_strategy(self),
            grid,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )


def as_engine_strategy(strategy: object) -> EngineStrategy:
    """``strategy`` itself if it is an ``EngineStrategy``, else Flower's wrapped.

    Parameters
    ----------
    strategy : object
        flplatform's strategy, or a ``flwr.serverapp.strategy.Strategy``.

    Returns
    -------
    EngineStrategy
        What the round engine drives.

    Raises
    ------
    ConfigError
        If ``strategy`` is neither, or has the streaming hooks but not the rest of
        ``EngineStrategy`` (subclass it to inherit the defaults).
    """
    if isinstance(strategy, EngineStrategy):
        return strategy
    if all(callable(getattr(strategy, hook, None)) for hook in STREAMING_HOOKS):
        raise ConfigError(
            f"{type(strategy).__name__} has the engine's streaming hooks but not the rest of "
            "flplatform.engine.EngineStrategy: subclass it to inherit the defaults"
        )
    if isinstance(strategy, Strategy):
        # Imported here: the adapter imports strategies.local_sgd, which imports this module.
        from strategies.flower_adapter import FlowerStrategyAdapter

        return FlowerStrategyAdapter(strategy)
    raise ConfigError(
        f"start() runs a Flower strategy (flwr.serverapp.strategy.Strategy) or one of "
        f"flplatform's, got {type(strategy).__name__}"
    )


def strategy_name(strategy: EngineStrategy) -> str:
    """The strategy's name in the ledger: its ``ledger_name``, else its class name."""
    named = strategy.ledger_name
    return named if isinstance(named, str) and named else type(strategy).__name__


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
        resolved, overrides = _resolve(PlatformOptions(**options))
        run = _open_run(resolved, overrides, strategy)
    except FLPlatformError as problem:
        log.error("could not record the failed run: %s", problem.reason)
        return
    if run is not None:
        run.fail(exc)


def choose_policy(strategy: EngineStrategy, options: PlatformOptions) -> AggregationPolicy:
    """The requested synchrony mode, or the policy the strategy picks for it.

    Parameters
    ----------
    strategy : EngineStrategy
        The strategy the engine drives; its ``engine_policy`` decides.
    options : PlatformOptions
        The mode and its options, the seed and the number of rounds.

    Returns
    -------
    AggregationPolicy
        What the engine runs under.

    Raises
    ------
    ConfigError
        For a bad mode or option, or a mode the strategy cannot run.
    """
    requested = Synchrony(
        options.sync,
        k=options.k,
        staleness_bound=options.staleness_bound,
        weighting=options.staleness_weighting,
        step_c=options.staleness_step_c,
        adasync=options.adasync,
        concurrency=options.concurrency,
        seed=options.seed,
    )
    return strategy.engine_policy(requested, num_rounds=options.num_rounds)


def _clock(options: PlatformOptions) -> Clock:
    """The virtual clock over the network asked for, or the wall clock."""
    network = options.network
    overridden = bool(options.compute_model or options.step_seconds)
    if network is None or network == "":
        if overridden:
            raise ConfigError(
                "compute_model and step_seconds shape a simulated network's compute times: "
                "also give network (a preset such as world, or a profile .toml)"
            )
        return WallClock()
    if isinstance(network, Network):
        if overridden:
            raise ConfigError(
                "compute_model and step_seconds override the profiles of a network named by "
                "preset or file; build the Network object with the compute models you want"
            )
        return VirtualClock(network, seed=options.seed)
    loaded = load_network(
        network,
        seed=options.seed,
        compute_model=options.compute_model,
        step_seconds=options.step_seconds,
    )
    return VirtualClock(loaded, seed=options.seed)


def _network_label(options: PlatformOptions) -> str | None:
    """The simulated network as the ledger names it; None on the wall clock."""
    if isinstance(options.network, Network):
        return options.network.name
    return options.network or None


# ================================================================ the ledger
def _resolve(given: PlatformOptions) -> tuple[PlatformOptions, dict[str, Any]]:
    """The options to run with: ``given`` (checked) overridden by ``FLPLATFORM_OPTIONS``.

    Returns the options and the overrides that applied.
    """
    _checked({n: getattr(given, n) for n in OPTION_NAMES}, source="start()")
    overrides = options_from_environment()
    return replace(given, **overrides), overrides


def _open_run(
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
        network=_network_label(options),
    )


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


# ============================================================ logging
def _log_start(
    strategy: EngineStrategy,
    label: str,
    policy: AggregationPolicy,
    network: str | None,
    num_rounds: int,
) -> None:
    log.info(
        "flplatform: %s, %d rounds, %s, %s",
        label,
        num_rounds,
        repr(policy) if isinstance(policy, Synchrony) else type(policy).__name__,
        f"network {network} (virtual clock)" if network else "wall clock",
    )
    strategy.summary()


def _round_reporter(
    on_round: Callable[[RoundSummary], None] | None,
) -> Callable[[RoundSummary], None]:
    """Log every round, then hand it to the caller's ``on_round``."""

    def report(summary: RoundSummary) -> None:
        log_round(summary)
        if on_round is not None:
            on_round(summary)

    return report


def log_round(summary: RoundSummary) -> None:
    """One line per finished round: version, updates, bytes, simulated time, metrics."""
    metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
    simulated = (
        f", simulated t={summary.virtual_finished_at:.2f} s"
        if summary.virtual_finished_at is not None
        else ""
    )
    log.info(
        "round %d: version %d, %d updates, %d B up, %d B down%s, %s",
        summary.server_round,
        summary.model_version,
        len(summary.updates),
        summary.bytes_up,
        summary.bytes_down,
        simulated,
        metrics,
    )


# ================================================== options from the command line
def options_environment(**options: Any) -> dict[str, str]:
    """The environment that hands ``options`` to ``start`` in a ServerApp process.

    Parameters
    ----------
    **options
        ``start()`` keyword names and JSON values (``network`` as a preset or path).

    Returns
    -------
    dict[str, str]
        ``{OPTIONS_ENV: <JSON object>}``, to merge into the process's environment.

    Raises
    ------
    ConfigError
        For an unknown option or a bad value, naming it.
    """
    checked = _checked(options, source="options_environment()")
    return {OPTIONS_ENV: json.dumps(checked, allow_nan=False, sort_keys=True)}


def options_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``start()`` options ``FLPLATFORM_OPTIONS`` sets (empty when it is unset).

    Parameters
    ----------
    environ : mapping, optional
        The environment to read (default: ``os.environ``).

    Returns
    -------
    dict[str, Any]
        Option name → value, checked.

    Raises
    ------
    ConfigError
        If the variable is not a JSON object, or names an unknown option or a bad value.
    """
    text = (os.environ if environ is None else environ).get(OPTIONS_ENV, "").strip()
    if not text:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{OPTIONS_ENV} must be a JSON object of start() options; it is not JSON "
            f"({exc.msg} at character {exc.pos})"
        ) from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"{OPTIONS_ENV} must be a JSON object of start() options, got {type(values).__name__}"
        )
    return _checked(values, source=OPTIONS_ENV)


def _checked(values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """``values`` (names in snake- or kebab-case) checked, by snake-case name."""
    out: dict[str, Any] = {}
    unknown = []
    for raw, value in values.items():
        option = str(raw).replace("-", "_")
        if option not in OPTION_NAMES:
            unknown.append(str(raw))
            continue
        problem = _problem(option, value, objects=source == "start()")
        if problem:
            raise ConfigError(f"{source}: option '{option}' {problem}, got {value!r}")
        out[option] = value
    if unknown:
        raise ConfigError(
            f"{source}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) for u in unknown)}; allowed: {', '.join(OPTION_NAMES)}"
        )
    return out


def _problem(option: str, value: Any, *, objects: bool) -> str | None:
    """What is wrong with ``value`` for ``option`` (None when nothing is).

    ``objects``: whether values that JSON cannot carry (a ``Network``) are allowed.
    """
    if value is None and option in _NULLABLE:
        return None
    if option == "network" and objects and isinstance(value, Network):
        return None
    rule = _RULES[option]
    return None if rule.accepts(value) else rule.says


@dataclass(frozen=True)
class _Rule:
    """What one option accepts, and the words for it."""

    says: str
    kind: str  # "int", "number", "text", "flag", "mapping", "mode"
    minimum: float = -math.inf
    strict: bool = False  # minimum excluded

    def accepts(self, value: Any) -> bool:
        if self.kind == "flag":
            return isinstance(value, bool)
        if self.kind == "text":
            return isinstance(value, str)
        if self.kind == "mode":
            return value in SYNC_MODES
        if self.kind == "mapping":
            return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        return value > self.minimum if self.strict else value >= self.minimum


_RULES = {
    "num_rounds": _Rule("must be an integer >= 1", "int", 1),
    "timeout": _Rule("must be a number of seconds > 0", "number", 0, strict=True),
    "sync": _Rule(f"must be one of {', '.join(SYNC_MODES)}", "mode"),
    "k": _Rule("must be an integer >= 1", "int", 1),
    "staleness_bound": _Rule("must be an integer >= 0 or null (no bound)", "int", 0),
    "staleness_weighting": _Rule("must be a weighting name or null", "text"),
    "staleness_step_c": _Rule("must be a number > 0", "number", 0, strict=True),
    "adasync": _Rule("must be true or false", "flag"),
    "concurrency": _Rule("must be an integer >= 0 (0: every site)", "int", 0),
    "network": _Rule("must be a preset name, a .toml path or null", "text"),
    "compute_model": _Rule("must be a compute model name (or empty)", "text"),
    "step_seconds": _Rule("must be a number >= 0 (0: keep the profiles')", "number", 0),
    "seed": _Rule("must be an integer", "int"),
    "ledger": _Rule("must be a database URL, 'default' or null (no ledger)", "text"),
    "name": _Rule("must be a text or null", "text"),
    "run_config": _Rule("must be an object with text keys or null", "mapping"),
    "tag": _Rule("must be a text or null", "text"),
    "required_sites": _Rule("must be an integer >= 0", "int", 0),
    "max_failed_rounds": _Rule("must be an integer >= 0 (0: never stop)", "int", 0),
}
# Options that may be None (JSON null): "not set" (no bound, no network, no ledger, ...).
_NULLABLE = frozenset(
    ("staleness_bound", "staleness_weighting", "network", "ledger", "name", "run_config", "tag")
)


# ============================================= ``flplatform.start(...)`` is callable
class _CallableModule(types.ModuleType):
    """This module's type: calling ``flplatform.start`` (the module) calls ``start``.

    Importing ``flplatform.start`` binds the module to the package's ``start`` attribute,
    whichever import came first; this keeps ``flplatform.start(...)`` the function call.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Result:
        return start(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
