"""The run options' vocabulary and the rules across them.

What an option is (:class:`Option`, the metadata of each of ``RunConfig``'s fields in
``flplatform/app/config.py``), the strategies' names, and :func:`problems`: every reason a
configuration cannot run, gathered before anything is raised. A strategy's own knobs are
asked of its knobs object (``strategies/knobs.py``), as its constructor asks them, so each
rule is written once; that module loads no torch, so neither does checking a configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from typing import TYPE_CHECKING, Any

from clients.catalog import BUILTIN_DATASETS, MODELS
from flplatform.core.checks import Problem, integer, number, one_of, positive, unit_interval
from flplatform.core.errors import ConfigError
from flplatform.engine.guard import guard_problems
from flplatform.engine.synchrony import (
    BATCH_MODES,
    SYNC_MODES,
    k_sites_problem,
    most_updates_a_round,
    synchrony_problems,
)
from flplatform.run.options import option_problem
from strategies.averaged_arrays import split_names
from strategies.knobs import (
    DELAYED_SYNC_ONLY,
    DelayedKnobs,
    FetchSGDKnobs,
    LocalSGDKnobs,
    SketchedSGDKnobs,
    StrategyKnobs,
    codec_problem,
    robust_aggregation_problem,
    sample_size,
    sketched_sync_only,
)

if TYPE_CHECKING:
    from flplatform.app.config import RunConfig

LOCAL_SGD = "local-sgd"
DELAYED = "delayed"
FETCHSGD = "fetchsgd"
SKETCHED_SGD = "sketched-sgd"
SKETCHED = (FETCHSGD, SKETCHED_SGD)  # strategies whose sites upload count sketches
# Names users know from Flower and the literature, all the same algorithm here.
STRATEGY_ALIASES = {
    "fedavg": LOCAL_SGD,
    "fedavgm": LOCAL_SGD,
    "diloco": LOCAL_SGD,
    LOCAL_SGD: LOCAL_SGD,
    DELAYED: DELAYED,
    "dts": DELAYED,
    "dga": DELAYED,
    FETCHSGD: FETCHSGD,
    SKETCHED_SGD: SKETCHED_SGD,
}
# Flower refuses message TTLs beyond its own limits; a week is far beyond any real round.
MAX_ROUND_TIMEOUT = 7 * 24 * 3600.0

SHAPE_MISUSE = "{name} shapes the sketches of strategy {owners}, not '{strategy}'"
DELAYED_MISUSE = (
    "{names} shape delayed compensated updates: use them with strategy 'delayed', not '{strategy}'"
)
CODEC_MISUSE = (
    "codec compresses delta uploads (strategies local-sgd and delayed); strategy "
    "'{strategy}' uploads sketches: leave codec 'none'"
)
SERVER_NESTEROV_MISUSE = (
    "{name} shapes the server momentum (server-momentum) of strategies local-sgd and "
    "delayed, which strategy '{strategy}' does not use: leave {name} at its default"
)
MOMENTUM_EVERY_MISUSE = (
    "{name} is local-sgd's delayed Nesterov momentum (for its asynchronous modes); strategy "
    "'{strategy}' does not use it: leave {name} at its default"
)
SERVER_MOMENTUM_MISUSE = {
    FETCHSGD: "server-momentum is local-SGD's server momentum β; FetchSGD's sketch momentum ρ "
    "is sketch-momentum: set that instead",
    SKETCHED_SGD: "server-momentum is local-SGD's server momentum β; Sketched-SGD's step "
    "momentum m (kept at the sites) is step-momentum: set that instead",
}


@dataclass(frozen=True)
class Option:
    """What the table says of one option beyond its name, type and default.

    Parameters
    ----------
    help : str
        One line for ``--help`` and the pyproject comment.
    allowed : tuple of str
        The values allowed, where they are a closed list (checked with the family's
        ``one_of``); () where the help says what is allowed.
    strategies : tuple of str
        The strategies whose behaviour it shapes; () for every strategy. Set to anything
        but its default under another strategy, it is refused with ``misuse``.
    misuse : str or mapping
        The refusal: a template over ``{name}`` (or ``{names}``: the options sharing it
        are named together), ``{owners}`` and ``{strategy}``; or one text per strategy.
    cli : str or None
        Its ``flplatform simulate`` option's name when not the key's; None: not a CLI option.
    """

    help: str
    allowed: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    misuse: str | Mapping[str, str] = SHAPE_MISUSE
    cli: str | None = ""


def about(help: str, **options: Any) -> dict[str, Option]:
    """A field's metadata: its :class:`Option`."""
    return {"option": Option(help, **options)}


def option_of(f: Field[Any]) -> Option:
    """The :class:`Option` of one of ``RunConfig``'s fields."""
    return f.metadata["option"]


# ---------------------------------------------------------------------- the rules
def problems(config: RunConfig) -> list[str]:
    """Every reason this configuration cannot run (empty when it can); changes nothing."""
    problems: list[Problem] = [
        one_of(getattr(config, f.name), f.name.replace("_", "-"), option_of(f).allowed)
        for f in fields(config)
        if option_of(f).allowed
    ]
    if config.strategy in STRATEGY_ALIASES.values():
        problems += _misused(config)
        problems += _strategy_problems(config)
    if config.sync in SYNC_MODES:
        problems += synchrony_problems(
            config.sync,
            k=config.sync_k,
            staleness_bound=config.staleness_bound,
            weighting=config.staleness_weighting,
            adasync=config.adasync,
            concurrency=config.concurrency,
            step_c=config.staleness_step_c,
        )
        if config.strategy not in SKETCHED:  # their k counts coordinates, not updates
            problems.append(k_sites_problem(config.sync, config.sync_k, config.num_sites))
        if config.strategy == LOCAL_SGD and not config.adasync:  # AdaSync's K grows
            problems.append(
                robust_aggregation_problem(
                    config.aggregator,
                    config.trim_fraction,
                    most_updates_a_round(
                        config.sync,
                        k=config.sync_k,
                        sampled=sample_size(config.fraction_train, config.num_sites),
                    ),
                )
            )
        if config.sync in BATCH_MODES and config.fraction_train < 1.0:
            # Batch modes offer work again at every arrival: a per-offer fraction would
            # not bound how many sites train; concurrency does.
            problems.append(
                f"fraction-train < 1 samples the sites of a round; sync mode {config.sync!r} "
                "gives work at every arrival: bound the sites training at once with "
                "concurrency instead"
            )
    problems += _edge_problems(config)
    return [p for p in problems if p]


def _misused(config: RunConfig) -> list[Problem]:
    """Options set away from their default under a strategy they do not shape."""
    # (template, the strategies it names, the option that starts the group) → option keys
    misused: dict[tuple[str, tuple[str, ...], str], list[str]] = {}
    for f in fields(config):
        about = option_of(f)
        if not about.strategies or config.strategy in about.strategies:
            continue
        if getattr(config, f.name) == f.default:
            continue
        template = about.misuse
        if not isinstance(template, str):
            template = template.get(config.strategy, SHAPE_MISUSE)
        key = f.name.replace("_", "-")
        group = (template, about.strategies, "" if "{names}" in template else key)
        misused.setdefault(group, []).append(key)
    return [
        template.format(
            name=names[0],
            names=", ".join(names),
            owners=" and ".join(repr(s) for s in owners),
            strategy=config.strategy,
        )
        for (template, owners, _), names in misused.items()
    ]


def strategy_knobs(config: RunConfig) -> StrategyKnobs:
    """The knobs of the strategy ``config`` names (``flplatform.app.federation.build_strategy``
    passes them to its constructor, which asks them the same questions)."""
    if config.strategy == DELAYED:
        return DelayedKnobs(
            delay=config.delay,
            num_rounds=config.num_server_rounds,
            compensate=config.compensation,
            eta=config.server_lr,
            beta=config.server_momentum,
            nesterov=config.server_nesterov,
            fragments=config.fragments,
            fraction_evaluate=config.fraction_evaluate,
            codec=config.codec,
            averaged_arrays=split_names(config.averaged_arrays),
        )
    if config.strategy == FETCHSGD:
        return FetchSGDKnobs(
            k=config.k,
            sketch_rows=config.sketch_rows,
            sketch_cols=config.sketch_cols,
            fraction_train=config.fraction_train,
            fraction_evaluate=config.fraction_evaluate,
            rho=config.sketch_momentum,
            eta=config.server_lr,
            removal=config.sketch_removal,
            averaged_arrays=split_names(config.averaged_arrays),
        )
    if config.strategy == SKETCHED_SGD:
        return SketchedSGDKnobs(
            k=config.k,
            sketch_rows=config.sketch_rows,
            sketch_cols=config.sketch_cols,
            fraction_train=config.fraction_train,
            fraction_evaluate=config.fraction_evaluate,
            candidate_factor=config.candidate_factor,
            momentum=config.step_momentum,
            eta=config.server_lr,
            averaged_arrays=split_names(config.averaged_arrays),
        )
    return LocalSGDKnobs(
        eta=config.server_lr,
        beta=config.server_momentum,
        nesterov=config.server_nesterov,
        momentum_every=config.server_momentum_every,
        fraction_train=config.fraction_train,
        fraction_evaluate=config.fraction_evaluate,
        codec=config.codec,
        aggregator=config.aggregator,
        trim_fraction=config.trim_fraction,
        clip_radius=config.clip_radius,
        averaged_arrays=split_names(config.averaged_arrays),
    )


def _strategy_problems(config: RunConfig) -> list[Problem]:
    """The strategy's own knobs, asked of its knobs object, and what the edge adds to them."""
    problems: list[Problem] = []
    if config.strategy in SKETCHED:
        problems.append(sketched_sync_only(config.strategy).problem(config.sync))
    elif config.strategy == DELAYED:
        problems.append(DELAYED_SYNC_ONLY.problem(config.sync))
    problems += strategy_knobs(config).problems()
    if config.strategy == DELAYED:
        problems.append(
            integer(
                config.period, "period", minimum=0, says=">= 0 local steps (0: use local-steps)"
            )
        )
        if config.fraction_train != 1.0:
            problems.append(
                "strategy 'delayed' trains every site every period; fraction-train must be 1"
            )
    return problems


def _edge_problems(config: RunConfig) -> list[Problem]:
    """What only the run configuration knows: data, model, sites, rounds, network."""
    problems: list[Problem] = [
        # a bad spec names what is allowed (for local-SGD and delayed, their knobs say it)
        None if config.strategy in (LOCAL_SGD, DELAYED) else codec_problem(config.codec),
        _network_problem(config),
        _raised(_check_model, config.model),
        _dataset_problem(config),
        positive(config.num_server_rounds, "num-server-rounds"),
        positive(config.batch_size, "batch-size"),
    ]
    if config.standardize_features and config.fraction_evaluate <= 0:
        problems.append(
            "standardize-features keeps each site's statistics at the site, so the server "
            "cannot score the model on its unscaled test set: set fraction-evaluate > 0 "
            "(e.g. 1) to have the sites evaluate it on their own standardised data"
        )
    if config.local_steps < 0 or config.local_epochs < 0:
        problems.append("local-steps and local-epochs must be >= 0")
    if config.local_steps == 0 and config.local_epochs == 0:
        problems.append("set local-steps (H > 0) or local-epochs (E > 0); both are 0")
    problems += [
        positive(config.alpha, "alpha", says="a finite number > 0"),
        positive(config.lr, "lr"),
        unit_interval(config.momentum, "momentum"),
        None if config.sites else "sites must name at least one site",
        integer(config.min_sites, "min-sites", minimum=0, says=">= 0"),
        positive(config.round_timeout, "round-timeout"),
        number(
            config.round_timeout,
            "round-timeout",
            at_most=MAX_ROUND_TIMEOUT,
            says=f"at most {MAX_ROUND_TIMEOUT:.0f} s (7 days)",
        )
        if config.round_timeout > 0
        else None,
        # start()'s own rules for the options it shares (flplatform/run/options.py)
        *(
            option_problem(name, getattr(config, name), name.replace("_", "-"))
            for name in ("seed", "max_failed_rounds", "checkpoint_every", "keep_checkpoints")
        ),
        integer(config.resume_run, "resume-run", minimum=0, says="a run id, or 0 (a new run)"),
        *guard_problems(
            update_norm_ratio=config.update_norm_ratio,
            update_norm_action=config.update_norm_action,
            max_site_share=config.max_site_share,
            reject_replays=config.reject_replays,
            update_min_cosine=config.update_min_cosine,
        ),
    ]
    return problems


def _network_problem(config: RunConfig) -> Problem:
    if config.network:
        return _raised(config.load_network)  # a bad preset or profile file fails here
    if config.compute_model or config.step_seconds:
        return (
            "compute-model and step-seconds shape a simulated network's compute times: "
            "also set network (a preset such as world, or a profile .toml)"
        )
    return None


def _dataset_problem(config: RunConfig) -> Problem:
    if config.partition == "files":
        if config.dataset in BUILTIN_DATASETS or config.dataset.endswith(".npz"):
            return (
                "partition 'files' reads one file per site: set dataset to the directory "
                "written by `flplatform data split` (it holds manifest.json)"
            )
    elif config.dataset not in BUILTIN_DATASETS and not config.dataset.endswith(".npz"):
        return (
            f"unknown dataset '{config.dataset}'; allowed: {', '.join(BUILTIN_DATASETS)}"
            " or a path to a .npz file with arrays x and y"
        )
    return None


def _raised(check: Any, *args: Any) -> Problem:
    """The reason of the ``ConfigError`` that ``check(*args)`` raises, or None."""
    try:
        check(*args)
    except ConfigError as exc:
        return exc.reason
    return None


def _check_model(model: str) -> None:
    """A built-in model's name, or a ``MODULE:FACTORY`` spec that imports and builds one.

    The spec is imported and called here, at the edge: an unimportable module or a factory
    that returns no ``nn.Module`` is one clear line before any process starts.
    """
    if model in MODELS:
        return
    if ":" not in model:
        raise ConfigError(
            f"unknown model '{model}'; allowed: {', '.join(MODELS)}, or MODULE:FACTORY "
            "(a zero-argument callable returning a torch.nn.Module, e.g. own_app.task:Net)"
        )
    from clients.models import instantiate_model_spec  # imports torch: only for a spec

    instantiate_model_spec(model)
