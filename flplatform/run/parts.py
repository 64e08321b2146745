"""The round engine's parts that ``start`` makes from its arguments: strategy, policy, clock.

Any strategy runs: flplatform's own (each an ``EngineStrategy``) as they are, Flower's own
(FedAvg, FedProx, FedAdam, ...) wrapped in ``flplatform.run.flower_adapter.FlowerStrategyAdapter``,
fully synchronously. A strategy chooses the policy it runs the requested mode with
(``EngineStrategy.engine_policy``). A network, named or given, puts the run on its virtual
clock; without one the run keeps the wall clock.
"""

from __future__ import annotations

from flwr.serverapp.strategy import Strategy

from flplatform.core.errors import ConfigError
from flplatform.engine import AggregationPolicy, EngineStrategy, Synchrony
from flplatform.engine.clock import Clock, VirtualClock, WallClock
from flplatform.network import Network, load_network
from flplatform.run.options import PlatformOptions

# The engine's hooks a strategy of its own has (Flower's strategies lack them, and are wrapped).
STREAMING_HOOKS = ("begin_aggregation", "accumulate", "finish_aggregation")


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
        # Imported here: the adapter imports strategies.local_sgd, which imports flplatform.start.
        from flplatform.run.flower_adapter import FlowerStrategyAdapter

        return FlowerStrategyAdapter(strategy)
    raise ConfigError(
        f"start() runs a Flower strategy (flwr.serverapp.strategy.Strategy) or one of "
        f"flplatform's, got {type(strategy).__name__}"
    )


def strategy_name(strategy: EngineStrategy) -> str:
    """The strategy's name in the ledger: its ``ledger_name``, else its class name."""
    named = strategy.ledger_name
    return named if isinstance(named, str) and named else type(strategy).__name__


def codec_name(strategy: EngineStrategy) -> str:
    """The upload codec a strategy asks its sites for (its ``codec``'s name, as local-SGD
    and delayed updates keep it); ``"none"`` for a strategy without one."""
    name = getattr(getattr(strategy, "codec", None), "name", "none")
    return name if isinstance(name, str) and name else "none"


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


def make_clock(options: PlatformOptions) -> Clock:
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
    # A message naming no work is timed by the site's measurement, unless the run chose
    # a compute model for every site.
    return VirtualClock(loaded, seed=options.seed, measure_unplanned=not options.compute_model)


def network_label(options: PlatformOptions) -> str | None:
    """The simulated network as the log and the ledger name it; None on the wall clock."""
    if isinstance(options.network, Network):
        return options.network.name
    return options.network or None
