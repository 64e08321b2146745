"""The run's options, said once: ``RunConfig``'s fields are the table.

Each field is one option: its name (kebab-case in a Flower run config and on the CLI), its
type and default, and in its metadata an :class:`~flplatform.app.config_rules.Option`: the help
text, the values allowed and the strategies it shapes. From that table follow

* the Flower run-config keys, ``[tool.flwr.app.config]`` of ``pyproject.toml``, written by
  ``python -m flplatform.app.app_config`` (Flower reads the static file; a test fails when the
  file and the table disagree);
* the CLI options of ``flplatform simulate`` and ``flplatform run`` (``flplatform/cli/options.py``);
* the checks: :meth:`RunConfig.from_mapping` parses once at the edge, resolves aliases and
  raises one ``ConfigError`` listing every problem (``flplatform/app/config_rules.py``).

Components receive explicit keyword arguments taken from this object, never the mapping.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any

from clients.catalog import BUILTIN_DATASETS, MODELS, PARTITIONS
from flplatform.app.config_rules import (
    CODEC_MISUSE,
    DELAYED,
    DELAYED_MISUSE,
    FETCHSGD,
    LOCAL_SGD,
    MOMENTUM_EVERY_MISUSE,
    SERVER_MOMENTUM_MISUSE,
    SERVER_NESTEROV_MISUSE,
    SKETCHED,
    SKETCHED_SGD,
    STRATEGY_ALIASES,
    about,
    problems,
)
from flplatform.core.checks import DEFAULT_SITES, Problem, as_bool, as_site_names, require
from flplatform.core.errors import ConfigError
from flplatform.engine.guard import NORM_ACTIONS
from flplatform.engine.synchrony import SYNC_MODES
from flplatform.network import Network, load_network
from flplatform.run.options import DEFAULT_OPTIONS

__all__ = [
    "DEFAULT_SITES",
    "DELAYED",
    "FETCHSGD",
    "LOCAL_SGD",
    "SKETCHED",
    "SKETCHED_SGD",
    "STRATEGY_ALIASES",
    "RunConfig",
    "option_keys",
]


@dataclass(frozen=True)
class RunConfig:
    """Everything one federated run needs; each field is one option (see the module)."""

    # ---- the algorithm
    strategy: str = field(
        default=LOCAL_SGD,
        metadata=about(
            "local-sgd (fedavg, fedavgm, diloco), delayed (dts, dga), fetchsgd or sketched-sgd.",
            allowed=tuple(sorted(STRATEGY_ALIASES)),
        ),
    )
    sync: str = field(
        default=DEFAULT_OPTIONS.sync,
        metadata=about(
            "sync, k-sync, k-batch-sync, async, k-async, k-batch-async or buffered.",
            allowed=SYNC_MODES,
        ),
    )
    num_server_rounds: int = field(default=20, metadata=about("Server rounds.", cli="rounds"))
    # ---- data and model
    dataset: str = field(
        default="digits",
        metadata=about(f"{', '.join(BUILTIN_DATASETS)}, or a .npz path."),
    )
    partition: str = field(
        default="dirichlet",
        metadata=about(
            "iid, dirichlet, or files (dataset = a `data split` directory).", allowed=PARTITIONS
        ),
    )
    alpha: float = field(default=0.5, metadata=about("Dirichlet α (> 0; smaller is more skewed)."))
    model: str = field(
        default="mlp",
        metadata=about(
            f"{', '.join(MODELS)} (wide-mlp: 509k parameters; resnet: 1.3M, with "
            "BatchNorm), or MODULE:FACTORY (a zero-argument "
            "callable returning your nn.Module, importable from here or the Python path)."
        ),
    )
    standardize_features: bool = field(
        default=False,
        metadata=about(
            "Each site standardises its features with its own training split's mean and "
            "standard deviation (never shared); the sites then evaluate the model "
            "(fraction-evaluate > 0), as the server's test set stays unscaled."
        ),
    )
    # ---- the sites' training
    local_steps: int = field(
        default=0, metadata=about("H local SGD steps per round (0: use epochs).")
    )
    local_epochs: int = field(default=2, metadata=about("E local epochs per round."))
    batch_size: int = field(default=32, metadata=about("Site mini-batch size."))
    lr: float = field(default=0.1, metadata=about("Site learning rate."))
    momentum: float = field(default=0.9, metadata=about("Site SGD momentum, reset each round."))
    # ---- the server's step
    server_lr: float = field(default=1.0, metadata=about("Server learning rate η."))
    server_momentum: float = field(
        default=0.0,
        metadata=about(
            "Local-SGD and delayed: server (outer) momentum β (local-SGD: > 0 is FedAvgM).",
            strategies=(LOCAL_SGD, DELAYED),
            misuse=SERVER_MOMENTUM_MISUSE,
        ),
    )
    server_nesterov: bool = field(
        default=False,
        metadata=about(
            "Local-SGD and delayed: Nesterov server momentum instead of heavy ball (needs "
            "server-momentum > 0; DiLoCo's outer step).",
            strategies=(LOCAL_SGD, DELAYED),
            misuse=SERVER_NESTEROV_MISUSE,
        ),
    )
    server_momentum_every: int = field(
        default=1,
        metadata=about(
            "Local-SGD with server-nesterov: the momentum moves every N-th server step only "
            "(delayed Nesterov, for the async modes); each step moves the model by "
            "server-lr·Δ̄/N besides. 1: every step.",
            strategies=(LOCAL_SGD,),
            misuse=MOMENTUM_EVERY_MISUSE,
        ),
    )
    fraction_train: float = field(default=1.0, metadata=about("Fraction of sites per round."))
    fraction_evaluate: float = field(
        default=0.0, metadata=about("Fraction of sites evaluating each round.")
    )
    seed: int = field(default=DEFAULT_OPTIONS.seed, metadata=about("Seed of every random choice."))
    # ---- the federation
    sites: tuple[str, ...] = field(
        default=DEFAULT_SITES,
        metadata=about("Number of sites, or comma-separated names (default 4, or the split's)."),
    )
    min_sites: int = field(
        default=0,
        metadata=about("Nodes to wait for before the first round (0: one per site).", cli=None),
    )
    db: str = field(default="", metadata=about("SQLAlchemy URL of the ledger."))
    run_tag: str = field(
        default="", metadata=about("A tag by which the run is found and followed.", cli=None)
    )
    name: str = field(
        default="",
        metadata=about("The run's name in the ledger (empty: <strategy>-<dataset>)."),
    )
    sweep: str = field(
        default="",
        metadata=about(
            "Several runs in this one Flower run: a JSON list of each run's options that "
            "differ from these (flplatform/app/sweep.py writes it; empty: one run).",
            cli=None,
        ),
    )
    round_timeout: float = field(
        default=600.0, metadata=about("Seconds a site may take per message.")
    )
    # ---- checkpoints and resume (flplatform/core/checkpoint.py, `flplatform resume`)
    checkpoint_every: int = field(
        default=DEFAULT_OPTIONS.checkpoint_every,
        metadata=about(
            "Keep the run's checkpoint every N rounds for `flplatform export` (0: only the "
            "final one); the latest round's is always kept for `flplatform resume`."
        ),
    )
    keep_checkpoints: int = field(
        default=DEFAULT_OPTIONS.keep_checkpoints,
        metadata=about("Most kept checkpoints of a run, besides the final one."),
    )
    checkpoint_dir: str = field(
        default="",
        metadata=about("Where checkpoints go (empty: $FLPLATFORM_HOME/checkpoints)."),
    )
    resume_run: int = field(
        default=0,
        metadata=about("Continue this run from its last checkpoint (0: a new run).", cli=None),
    )
    max_failed_rounds: int = field(
        default=DEFAULT_OPTIONS.max_failed_rounds,
        metadata=about(
            "Stop the run after this many rounds in a row applied no update although "
            "replies came back, whatever their reasons (0: never stop); after at most 2 "
            "when the sites' mods refused every failed reply (the app's train function)."
        ),
    )
    # ---- synchrony (flplatform/engine/synchrony.py)
    k: int = field(
        default=0,
        metadata=about(
            f"K of the K modes (0: {DEFAULT_OPTIONS.k}); for fetchsgd/sketched-sgd, the "
            "coordinates per step (required there)."
        ),
    )
    staleness_bound: int = field(
        default=-1, metadata=about("Async modes: most versions an update may lag (-1: none).")
    )
    staleness_weighting: str = field(
        default="",
        metadata=about("Async modes: none, sqrt (1/√(1+s)) or step (Dutta et al.)."),
    )
    staleness_step_c: float = field(
        default=DEFAULT_OPTIONS.staleness_step_c,
        metadata=about("C of the staleness-dependent step size."),
    )
    adasync: bool = field(
        default=DEFAULT_OPTIONS.adasync, metadata=about("Grow K as the training loss falls.")
    )
    concurrency: int = field(
        default=DEFAULT_OPTIONS.concurrency,
        metadata=about("Async modes: most sites training at once (0: all)."),
    )
    # ---- simulated network (flplatform/network/); "" runs on the wall clock
    network: str = field(
        default="",
        metadata=about(
            "Simulate a network: world, datacenter, mobile-4g, mobile-5g, or a .toml "
            "profile file (empty: real time)."
        ),
    )
    compute_model: str = field(
        default=DEFAULT_OPTIONS.compute_model,
        metadata=about(
            "Override the sites' compute model: fixed, exponential, shifted-exponential, "
            "pareto, measured (unset: the network's; work a run's messages do not name, "
            "no local-steps or local-epochs, is timed by what the sites measured)."
        ),
    )
    step_seconds: float = field(
        default=DEFAULT_OPTIONS.step_seconds,
        metadata=about("Override the mean compute seconds per local step."),
    )
    # ---- delayed compensated updates (strategies/delayed.py)
    delay: int = field(
        default=2,
        metadata=about(
            "Delayed: D, rounds until a period's average reaches a site.",
            strategies=(DELAYED,),
            misuse=DELAYED_MISUSE,
        ),
    )
    period: int = field(
        default=0,
        metadata=about(
            "Delayed: p local steps per message (0: use --local-steps).",
            strategies=(DELAYED,),
            misuse=DELAYED_MISUSE,
        ),
    )
    compensation: bool = field(
        default=True,
        metadata=about(
            "Delayed: swap each site's stale steps for the averages (ablation: off).",
            strategies=(DELAYED,),
            misuse=DELAYED_MISUSE,
        ),
    )
    fragments: int = field(
        default=1,
        metadata=about(
            "Delayed: streaming sync, the model split into F fragments and each round "
            "syncing one of them (1: the whole model every round).",
            strategies=(DELAYED,),
            misuse=DELAYED_MISUSE,
        ),
    )
    # ---- upload compression with error feedback (strategies/codecs.py)
    codec: str = field(
        default="none",
        metadata=about(
            "Local-SGD and delayed: compress uploads with error feedback: none, int8, int4, "
            "topk:<k> or topk:<fraction>.",
            strategies=(LOCAL_SGD, DELAYED),
            misuse=CODEC_MISUSE,
        ),
    )
    averaged_arrays: str = field(
        default="",
        metadata=about(
            "Model arrays the codecs and sketches must send exactly and set to the sites' "
            "weighted mean, beside the running statistics and integer arrays they find by "
            "themselves: names or patterns, comma-separated (e.g. '*.class_prior').",
        ),
    )
    # ---- robust aggregation: the update guard (flplatform/engine/guard.py), every strategy
    update_norm_ratio: float = field(
        default=DEFAULT_OPTIONS.update_norm_ratio,
        metadata=about(
            "Clip or reject an update whose norm exceeds this many times the recent median "
            "(0: no norm check)."
        ),
    )
    update_norm_action: str = field(
        default=DEFAULT_OPTIONS.update_norm_action,
        metadata=about(
            "What an update beyond the norm ratio gets: clip (scaled to the median) or reject.",
            allowed=NORM_ACTIONS,
        ),
    )
    max_site_share: float = field(
        default=DEFAULT_OPTIONS.max_site_share,
        metadata=about(
            "Largest share of the federation's examples one site's weight may claim (1: no cap)."
        ),
    )
    reject_replays: bool = field(
        default=DEFAULT_OPTIONS.reject_replays,
        metadata=about("Reject a reply identical to one the site sent before."),
    )
    update_min_cosine: float = field(
        default=DEFAULT_OPTIONS.update_min_cosine,
        metadata=about(
            "Reject an update when its site's mean cosine with the recent mean updates (over "
            "its recent updates) is below this, or its own is 0.5 below it (-1: no direction "
            "check)."
        ),
    )
    aggregator: str = field(
        default="centered-clip",
        metadata=about(
            "Local-SGD: combine updates by their weighted mean, median, trimmed-mean or "
            "centered-clip (each clipped to clip-radius recent distances from the last step).",
            strategies=(LOCAL_SGD,),  # (the strategy checks the name: one message)
        ),
    )
    trim_fraction: float = field(
        default=0.2,
        metadata=about(
            "Local-SGD trimmed-mean: fraction cut at each end, in [0, 0.5).",
            strategies=(LOCAL_SGD,),
        ),
    )
    clip_radius: float = field(
        default=1.0,
        metadata=about(
            "Local-SGD centered-clip: the radius, in median distances of recent updates from "
            "the last step's, > 0.",
            strategies=(LOCAL_SGD,),
        ),
    )
    # ---- sketched aggregation (strategies/fetchsgd.py, strategies/sketched_sgd.py)
    sketch_rows: int = field(
        default=5, metadata=about("Sketches: rows r (odd).", strategies=SKETCHED)
    )
    sketch_cols: int = field(
        default=0, metadata=about("Sketches: columns c (0: 5·k).", strategies=SKETCHED)
    )
    sketch_removal: str = field(
        default="zero",
        metadata=about(
            "FetchSGD: remove applied steps by 'zero' or 'subtract'.", strategies=(FETCHSGD,)
        ),
    )
    sketch_momentum: float = field(
        default=0.0,
        metadata=about(
            "FetchSGD: momentum ρ of the sketched updates, kept at the server.",
            strategies=(FETCHSGD,),
        ),
    )
    candidate_factor: int = field(
        default=2,
        metadata=about(
            "Sketched-SGD: P; the second round asks the sites for P·k values.",
            strategies=(SKETCHED_SGD,),
        ),
    )
    step_momentum: float = field(
        default=0.0,
        metadata=about(
            "Sketched-SGD: momentum m of the steps, kept at the sites.",
            strategies=(SKETCHED_SGD,),
        ),
    )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, allow_unknown: bool = False) -> RunConfig:
        """Parse a Flower run config (kebab-case keys) or CLI values; raise ``ConfigError``.

        Every problem is named in one error. Aliases are resolved here (``fedavg`` →
        ``local-sgd``), so the frozen config holds canonical values only.

        ``allow_unknown``: skip keys that are not ours (a Flower app's own keys, read by
        its own ClientApp) instead of refusing them; :meth:`unknown_keys` names them.
        """
        unknown = cls.unknown_keys(values)
        if unknown and not allow_unknown:
            allowed = ", ".join(sorted(key for key in option_keys()))
            require(f"unknown config key '{key}'; allowed keys: {allowed}" for key in unknown)
        given = {
            key.replace("-", "_"): value for key, value in values.items() if key not in unknown
        }
        kwargs: dict[str, Any] = {}
        problems: list[Problem] = []
        for f in fields(cls):
            if f.name in given:
                value, problem = _coerce(f, given[f.name])
                kwargs[f.name] = value
                problems.append(problem)
        require(problems)  # the types first: the rules below compare values
        raw = kwargs.get("strategy", cls.strategy)
        if raw == "fedavgm" and kwargs.get("server_momentum", 0.0) == 0.0:
            problems.append("fedavgm needs server-momentum > 0 (e.g. 0.9); 0 is plain fedavg")
        if raw == "diloco" and not kwargs.get("server_nesterov", False):
            problems.append(
                "diloco is local-sgd with Nesterov server momentum: set server-nesterov true "
                "and server-momentum > 0 (DiLoCo's: 0.9, with server-lr 0.7)"
            )
        kwargs["strategy"] = STRATEGY_ALIASES.get(raw, raw)
        kwargs["codec"] = str(kwargs.get("codec", cls.codec)).lower()
        config = cls(**kwargs)
        require(problems, config.problems())
        return config

    @classmethod
    def unknown_keys(cls, values: Mapping[str, Any]) -> list[str]:
        """The keys of ``values`` that are not RunConfig keys, sorted."""
        known = set(option_keys())
        return sorted(key for key in values if key.replace("_", "-") not in known)

    def to_run_config(self) -> dict[str, str | int | float | bool]:
        """Return the Flower run-config mapping (kebab-case keys) for this config."""
        out: dict[str, str | int | float | bool] = {}
        for key, value in asdict(self).items():
            out[key.replace("_", "-")] = ",".join(value) if isinstance(value, tuple) else value
        return out

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every value that is not allowed."""
        require(self.problems())

    def problems(self) -> list[str]:
        """Every reason this configuration cannot run (empty when it can); changes nothing."""
        return problems(self)

    # ---------------------------------------------------------------- helpers
    def load_network(self) -> Network | None:
        """The simulated network, or None for the wall clock; raise ``ConfigError``."""
        if not self.network:
            return None
        return load_network(
            self.network,
            seed=self.seed,
            compute_model=self.compute_model,
            step_seconds=self.step_seconds,
        )

    @property
    def run_name(self) -> str:
        """The run's name in the ledger: ``name``, else ``<strategy>-<dataset>``."""
        return self.name or f"{self.strategy}-{self.dataset}"

    @property
    def sync_k(self) -> int:
        """K of the K modes: ``k``, or start()'s default when k is 0 (not set)."""
        return self.k or DEFAULT_OPTIONS.k

    @property
    def num_sites(self) -> int:
        """Number of named sites (one simulated SuperNode each)."""
        return len(self.sites)

    @property
    def required_sites(self) -> int:
        """Nodes that must be connected before the first round starts."""
        return self.min_sites or self.num_sites


def option_keys() -> Iterator[str]:
    """The run-config keys (kebab-case), in the table's order."""
    return (f.name.replace("_", "-") for f in fields(RunConfig))


# ------------------------------------------------------------------- one value, typed
def _coerce(f: Field[Any], value: Any) -> tuple[Any, Problem]:
    """``value`` as the type of field ``f``'s default, or the default and a problem."""
    name = f.name.replace("_", "-")
    default = f.default
    try:
        if isinstance(default, bool):
            return as_bool(value, name), None
        if isinstance(default, int):
            return _as_int(name, value), None
        if isinstance(default, float):
            return _as_float(name, value), None
        if isinstance(default, tuple):
            return as_site_names(name, value), None
    except ConfigError as exc:
        return default, exc.reason
    return str(value).strip(), None


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        return float(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
