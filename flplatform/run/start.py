"""``flplatform.start``: the one call of a user's ServerApp that adds the platform's parts.

Where a Flower ServerApp calls ``strategy.start(grid, arrays, num_rounds=...)``, it calls
``flplatform.start(strategy, grid, arrays, num_rounds=..., sync="k-async", network="world",
ledger="default")`` instead and gets, on top of Flower's ``Result``:

* a synchrony mode (``flplatform.engine.synchrony``): sync, K-sync, K-async, buffered, ...;
* a simulated network on a virtual clock (``flplatform.network``), or the wall clock;
* the ledger: the run's row is written first, each round is committed as it finishes, and
  the run is marked finished, or failed with the reason, at the end (``run_record``);
* a watch on the SuperLink: a ServerApp whose SuperLink exited stops, the run failed with
  that reason, instead of training on or waiting on it for ever (``engine.link``).

Any strategy runs: flplatform's own as they are, Flower's own wrapped, fully synchronously
(``parts``, which also picks the policy and the clock). Command-line overrides:
``flplatform run APP_DIR --network world --sync k-async`` hands its options to the
ServerApp process in ``FLPLATFORM_OPTIONS`` (``options``; build it with
``options_environment``); they override the keyword arguments the ServerApp's code passed.

Importing the package stays light: ``flplatform.start`` is loaded on first use (the
package's ``__getattr__``), and this module, once loaded, is itself callable, so that
``import flplatform; flplatform.start(...)`` works whichever way it was first imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flplatform.core.errors import ConfigError
from flplatform.engine import EngineStrategy, RoundSummary
from flplatform.engine.engine import RoundEngine
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.engine.link import run_watched, watch_superlink
from flplatform.network import Network
from flplatform.run.log import log_start, round_reporter
from flplatform.run.options import (
    DEFAULT_OPTIONS,
    ConfigValue,
    PlatformOptions,
    options_environment,
    resolve_options,
)
from flplatform.run.owner import named_owner, owner_gone
from flplatform.run.parts import (
    as_engine_strategy,
    choose_policy,
    codec_name,
    make_clock,
    network_label,
    strategy_name,
)
from flplatform.run.run_record import WAIT_TIMEOUT_KEY, deployment_detail, open_run

# What users call: ``flplatform.start(...)``, ``PlatformStart`` (a strategy's base) and
# ``options_environment`` (the environment ``flplatform run`` hands a ServerApp).
__all__ = ["PlatformStart", "options_environment", "start"]

# On a deployment (`flplatform server`), how long a connected site has to answer the site
# query, the run's first message to it. A healthy site answers within seconds (Flower's
# 3 s polling, a fresh ClientApp process importing the app); one that has not answered in
# a minute runs no ClientApp for the run (a SuperNode left stale by a server stop, say):
# it is named, and no round waits for it until it answers (flplatform.engine.engine).
DEPLOYED_QUERY_SECONDS = 60.0


# =================================================================== the call
def start(
    strategy: Strategy | EngineStrategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int = DEFAULT_OPTIONS.num_rounds,
    timeout: float = DEFAULT_OPTIONS.timeout,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    sync: str = DEFAULT_OPTIONS.sync,
    k: int = DEFAULT_OPTIONS.k,
    staleness_bound: int | None = DEFAULT_OPTIONS.staleness_bound,
    staleness_weighting: str | None = DEFAULT_OPTIONS.staleness_weighting,
    staleness_step_c: float = DEFAULT_OPTIONS.staleness_step_c,
    adasync: bool = DEFAULT_OPTIONS.adasync,
    concurrency: int = DEFAULT_OPTIONS.concurrency,
    network: str | Network | None = DEFAULT_OPTIONS.network,
    compute_model: str = DEFAULT_OPTIONS.compute_model,
    step_seconds: float = DEFAULT_OPTIONS.step_seconds,
    seed: int = DEFAULT_OPTIONS.seed,
    ledger: str | None = DEFAULT_OPTIONS.ledger,
    name: str | None = DEFAULT_OPTIONS.name,
    run_config: Mapping[str, Any] | None = DEFAULT_OPTIONS.run_config,
    tag: str | None = DEFAULT_OPTIONS.tag,
    required_sites: int = DEFAULT_OPTIONS.required_sites,
    max_failed_rounds: int = DEFAULT_OPTIONS.max_failed_rounds,
    update_norm_ratio: float = DEFAULT_OPTIONS.update_norm_ratio,
    update_norm_action: str = DEFAULT_OPTIONS.update_norm_action,
    max_site_share: float = DEFAULT_OPTIONS.max_site_share,
    reject_replays: bool = DEFAULT_OPTIONS.reject_replays,
    update_min_cosine: float = DEFAULT_OPTIONS.update_min_cosine,
    checkpoint_every: int = DEFAULT_OPTIONS.checkpoint_every,
    keep_checkpoints: int = DEFAULT_OPTIONS.keep_checkpoints,
    checkpoint_dir: str | None = DEFAULT_OPTIONS.checkpoint_dir,
    resume_run: int | None = DEFAULT_OPTIONS.resume_run,
    on_round: Callable[[RoundSummary], None] | None = None,
    site_config: Mapping[str, ConfigValue] | None = None,
    should_stop: Callable[[int, Result], bool] | None = None,
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
        Unset, a training message that names no work (no ``local-steps`` or
        ``local-epochs``: your own loop decides) is timed by what the site measured.
    step_seconds : float
        Override every site's mean seconds per local step (0: keep the profiles').
    seed : int
        Seeds the policy's sampling and the network's speeds and compute times; >= 0 (the
        built-in sites refuse a negative seed, so every entry point does).
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
        Stop after this many rounds in a row that applied no update although replies came
        back and failed, whatever the reasons (``NoProgress``); 0 never stops.
    update_norm_ratio : float
        The update guard (``flplatform.engine.guard``), for every strategy: an update
        whose norm exceeds this many times the recent median is clipped or rejected;
        0 turns the check off.
    update_norm_action : {"clip", "reject"}
        What such an update gets: scaled down to the median norm, or rejected.
    max_site_share : float
        Largest share of the federation's examples one site's weight may claim, in
        (0, 1]; 1 caps nothing. (A weight is always capped at the examples the site
        declared when it joined.)
    reject_replays : bool
        Reject a reply identical to one the same site sent before.
    update_min_cosine : float
        Reject an update when its site's mean cosine over its recent updates (this one
        counted) with the federation's recent mean updates is below this, or its own is
        0.5 below it; −1 turns the direction check off (flplatform/engine/guard.py).
    checkpoint_every : int
        With a ledger, every round is committed with a checkpoint of the whole run state
        (the resume point; only the latest is kept); every ``checkpoint_every`` rounds
        one is kept for ``flplatform export`` (0: only the final one).
    keep_checkpoints : int
        Most kept checkpoints of the run, besides the final one (the oldest go first).
    checkpoint_dir : str, optional
        Where checkpoint files go (default ``$FLPLATFORM_HOME/checkpoints``).
    resume_run : int, optional
        Continue this run of the ledger from its last committed round instead of starting
        a new one (``flplatform resume``): the strategy, options and sites must be the
        ones it was started with; ``initial_arrays`` is ignored (the checkpoint holds the
        model).
    on_round : callable, optional
        Called with every finished round's ``RoundSummary`` (each is also logged).
    site_config : mapping, optional
        Run-config keys sent to the sites with every message (a ``ConfigRecord`` under
        ``keys.RUN_CONFIG``), which a ClientApp reads over its own run config
        (``clients.site.run_config_of``): how a run of a sweep tells the shared sites the
        data, model and app keys it reads differently. None sends nothing.
    should_stop : callable, optional
        ``(round, result) -> bool``, the keyword Flower 1.43's ``Strategy.start`` adds:
        asked after each recorded round but the last, with the result so far
        (``result.arrays`` that round's model, the metrics of every round until it); True
        ends the run after that round, finished with the rounds it has and a
        ``stopped-early`` event in the ledger (``flplatform history events``). A run
        resumed after its process died asks it again about its last round before going on.

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
        If the run could not start (too few sites) or failed before its end
        (``NoProgress``, or the SuperLink that runs it exited).
    """
    if should_stop is not None and not callable(should_stop):
        raise ConfigError(
            f"should_stop must be a function (round, result) -> bool, got {should_stop!r}"
        )
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
        update_norm_ratio=update_norm_ratio,
        update_norm_action=update_norm_action,
        max_site_share=max_site_share,
        reject_replays=reject_replays,
        update_min_cosine=update_min_cosine,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        checkpoint_dir=checkpoint_dir,
        resume_run=resume_run,
    )
    options, overrides = resolve_options(given)
    engine_strategy = as_engine_strategy(strategy)
    label = strategy_name(engine_strategy)
    policy = choose_policy(engine_strategy, options)
    clock = make_clock(options)
    # A simulated ServerApp's Grid answers after its SuperLink died, a deployed one's
    # retries for ever: stop then, failed with that reason (engine/link).
    grid = watch_superlink(grid)
    run = open_run(options, overrides, label, codec=codec_name(engine_strategy))
    resume = run.resume_state if run is not None else None
    log_start(engine_strategy, label, policy, network_label(options), options.num_rounds)
    engine: RoundEngine | None = None
    # On a deployment its sites are waited for as long as the server waits for them to
    # connect (--wait-timeout): to connect to the SuperLink, then to answer the site query.
    deployed = deployment_detail()
    wait = None if deployed is None else deployed.get(WAIT_TIMEOUT_KEY)
    startup = {} if wait is None else {"startup_timeout": float(wait)}

    def run_rounds() -> Result:
        nonlocal engine
        engine = RoundEngine(
            grid,
            engine_strategy,
            policy=policy,
            clock=clock,
            ledger=run.sink if run is not None else None,
            round_timeout=options.timeout,
            query_timeout=DEPLOYED_QUERY_SECONDS if deployed is not None else None,
            **startup,
            required_sites=options.required_sites,
            on_round=round_reporter(on_round),
            max_failed_rounds=options.max_failed_rounds,
            checkpoints=run is not None,
            run_key=run.run_key if run is not None else "",
            site_config=ConfigRecord(dict(site_config)) if site_config is not None else None,
            guard=UpdateGuard(
                GuardOptions(
                    norm_ratio=options.update_norm_ratio,
                    norm_action=options.update_norm_action,
                    max_share=options.max_site_share,
                    reject_replays=options.reject_replays,
                    min_cosine=options.update_min_cosine,
                )
            ),
        )
        return engine.run(
            initial_arrays,
            num_rounds=options.num_rounds,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            # As Flower's start: every round asks the strategy for evaluation messages (a
            # strategy that evaluates nothing sends none).
            federated_evaluation=True,
            resume=resume,
            should_stop=should_stop,
        )

    def record_failure(exc: BaseException) -> None:
        if run is None:
            return
        stopped = isinstance(exc, KeyboardInterrupt | SystemExit)
        if stopped and named_owner() is not None and not owner_gone():
            # The command that started the run is stopping its processes: it marks the run
            # failed with the signal's name once they are gone (launch/simulation.py), and
            # a text of ours written first would stay ("KeyboardInterrupt: " in a
            # simulation; "SystemExit: 0" deployed, where flwr-serverapp exits on SIGTERM).
            run.leave_to_owner()
            return
        run.fail(exc, simulated_seconds=engine.simulated_seconds if engine else None)

    # Whatever stops the rounds (an error, Ctrl-C, a SuperLink found gone: then the error
    # is RunFailed naming it) is recorded before it is raised.
    result = run_watched(grid, run_rounds, on_failure=record_failure)
    if run is not None:
        # the last round's (should_stop may have ended the run before the planned last)
        final = (
            result.evaluate_metrics_serverapp.get(engine.finished_round)
            if engine is not None
            else None
        )
        run.finish(
            final_metrics=final,
            simulated_seconds=engine.simulated_seconds if engine is not None else None,
        )
    return result


# ============================================= Flower's start, for our strategies
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
        should_stop: Callable[[int, Result], bool] | None = None,
    ) -> Result:
        """Flower's ``start`` signature (with 1.43's ``should_stop``); see the class."""
        return start(
            cast(EngineStrategy, self),  # every subclass is one; start() checks it
            grid,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            should_stop=should_stop,
        )
