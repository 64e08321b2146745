"""Run configuration, parsed once at the edge into a frozen dataclass.

The same keys live in ``[tool.flwr.app.config]`` (so ``flwr run . -c key=value`` works),
are passed by the CLI, and are validated here with messages that say what is allowed.
Components receive explicit keyword arguments taken from this object, never the mapping.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from flplatform.engine.synchrony import (
    BATCH_MODES,
    SYNC_MODES,
    synchrony_problems,
)
from flplatform.errors import ConfigError
from flplatform.network import Network, load_network
from strategies.codecs import make_codec
from strategies.delayed import SYNC_ONLY as DELAYED_SYNC_ONLY
from strategies.sketched_common import sync_only as sketched_sync_only

# Names users know from Flower and the literature, all the same algorithm here.
STRATEGY_ALIASES = {
    "fedavg": "local-sgd",
    "fedavgm": "local-sgd",
    "local-sgd": "local-sgd",
    "delayed": "delayed",
    "dts": "delayed",
    "dga": "delayed",
    "fetchsgd": "fetchsgd",
    "sketched-sgd": "sketched-sgd",
}
DELAYED = "delayed"
FETCHSGD = "fetchsgd"
SKETCHED_SGD = "sketched-sgd"
SKETCHED = (FETCHSGD, SKETCHED_SGD)  # strategies whose sites upload count sketches
MODELS = ("mlp", "cnn", "wide-mlp")
PARTITIONS = ("iid", "dirichlet", "files")
BUILTIN_DATASETS = ("digits", "mnist5k", "fashion-mnist")
DEFAULT_SITES = ("london", "ohio", "california", "tokyo")
# Flower refuses message TTLs beyond its own limits; a week is far beyond any real round.
MAX_ROUND_TIMEOUT = 7 * 24 * 3600.0
_SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class RunConfig:
    """Everything one federated run needs; see ``[tool.flwr.app.config]`` for defaults."""

    strategy: str = "local-sgd"
    sync: str = "sync"
    num_server_rounds: int = 20
    dataset: str = "digits"
    partition: str = "dirichlet"
    alpha: float = 0.5
    model: str = "mlp"
    local_steps: int = 0  # > 0: H local steps per round; 0: use local_epochs
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    server_lr: float = 1.0
    server_momentum: float = 0.0
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    seed: int = 0
    sites: tuple[str, ...] = DEFAULT_SITES
    min_sites: int = 0  # 0: wait for one node per named site
    db: str = ""  # "" means the default SQLite file
    run_tag: str = ""
    round_timeout: float = 600.0
    # stop the run after this many rounds in a row applied nothing, every reply failing
    # for the same reason (RoundEngine's stop rule); 0: never stop
    max_failed_rounds: int = 3
    # ---- synchrony (flplatform.engine.synchrony)
    k: int = 2  # K of the K modes
    staleness_bound: int = -1  # s of stale-synchronous parallel; -1: no bound
    staleness_weighting: str = ""  # none, sqrt, step; "": the mode's default
    staleness_step_c: float = 1.0  # C of the staleness-dependent step size
    adasync: bool = False  # grow K as the loss falls
    concurrency: int = 0  # async modes: most sites training at once; 0: all
    # ---- simulated network (flplatform.network); "" runs on the wall clock
    network: str = ""  # a preset (world, datacenter, mobile-4g, mobile-5g) or a .toml path
    compute_model: str = ""  # override every site's compute model
    step_seconds: float = 0.0  # override the mean compute seconds per local step; 0: keep
    # ---- delayed compensated updates (strategies/delayed.py)
    delay: int = 2  # D: rounds until a period's average reaches the site
    period: int = 0  # p: local steps per message; 0: local-steps / local-epochs decide
    compensation: bool = True  # swap the site's stale steps for the averages
    # ---- upload compression with error feedback (strategies/codecs.py): local-sgd, delayed
    codec: str = "none"  # none, int8, topk:<k> or topk:<fraction>
    # ---- sketched aggregation (strategies/fetchsgd.py, strategies/sketched_sgd.py); k is
    # the top-k, server-momentum FetchSGD's sketch momentum ρ or Sketched-SGD's step momentum
    sketch_rows: int = 5  # r, odd
    sketch_cols: int = 0  # c; 0: 5·k
    sketch_removal: str = "zero"  # FetchSGD: zero (the authors' code) or subtract (the paper)
    candidate_factor: int = 2  # Sketched-SGD: P, the values round asks for P·k coordinates

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, allow_unknown: bool = False) -> RunConfig:
        """Parse a Flower run config (kebab-case keys) or CLI values; raise ``ConfigError``.

        ``allow_unknown``: skip keys that are not ours (a Flower app's own keys, read by
        its own ClientApp) instead of refusing them; :meth:`unknown_keys` names them.
        """
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            if key not in known:
                if allow_unknown:
                    continue
                allowed = ", ".join(sorted(k.replace("_", "-") for k in known))
                raise ConfigError(f"unknown config key '{raw_key}'; allowed keys: {allowed}")
            kwargs[key] = value
        return cls._coerce(kwargs)

    @classmethod
    def unknown_keys(cls, values: Mapping[str, Any]) -> list[str]:
        """The keys of ``values`` that are not RunConfig keys, sorted."""
        known = {f.name for f in fields(cls)}
        return sorted(key for key in values if key.replace("-", "_") not in known)

    @classmethod
    def _coerce(cls, kwargs: dict[str, Any]) -> RunConfig:
        defaults = cls()
        out: dict[str, Any] = {}
        for f in fields(cls):
            value = kwargs.get(f.name, getattr(defaults, f.name))
            default = getattr(defaults, f.name)
            name = f.name.replace("_", "-")
            if isinstance(default, bool):
                out[f.name] = _as_bool(name, value)
            elif isinstance(default, int):
                out[f.name] = _as_int(name, value)
            elif isinstance(default, float):
                out[f.name] = _as_float(name, value)
            elif isinstance(default, tuple):
                out[f.name] = _as_names(name, value)
            else:
                out[f.name] = str(value).strip()
        config = cls(**out)
        config.validate()
        return config

    def to_run_config(self) -> dict[str, str | int | float | bool]:
        """Return the Flower run-config mapping (kebab-case keys) for this config."""
        out: dict[str, str | int | float | bool] = {}
        for key, value in asdict(self).items():
            out[key.replace("_", "-")] = ",".join(value) if isinstance(value, tuple) else value
        return out

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first value that is not allowed."""
        strategy = STRATEGY_ALIASES.get(self.strategy)
        if strategy is None:
            allowed = ", ".join(sorted(STRATEGY_ALIASES))
            raise ConfigError(f"unknown strategy '{self.strategy}'; allowed: {allowed}")
        if self.strategy == "fedavgm" and self.server_momentum == 0.0:
            raise ConfigError("fedavgm needs server-momentum > 0 (e.g. 0.9); 0 is plain fedavg")
        if strategy != self.strategy:
            object.__setattr__(self, "strategy", strategy)
        _one_of("sync", self.sync, SYNC_MODES)
        self._validate_delayed()
        self._validate_sketch()
        make_codec(self.codec)  # a bad spec fails here, saying what is allowed
        if self.codec.strip().lower() != "none" and self.strategy not in ("local-sgd", DELAYED):
            raise ConfigError(
                f"codec compresses delta uploads (strategies local-sgd and delayed); strategy "
                f"'{self.strategy}' uploads sketches: leave codec 'none'"
            )
        problems = synchrony_problems(
            self.sync,
            k=self.k,
            staleness_bound=self.staleness_bound,
            weighting=self.staleness_weighting,
            adasync=self.adasync,
            concurrency=self.concurrency,
            step_c=self.staleness_step_c,
        )
        if problems:
            raise ConfigError("; ".join(problems))
        if self.sync in BATCH_MODES and self.fraction_train < 1.0:
            # Batch modes offer work again at every arrival: a per-offer fraction would
            # not bound how many sites train; concurrency does.
            raise ConfigError(
                f"fraction-train < 1 samples the sites of a round; sync mode {self.sync!r} "
                "gives work at every arrival: bound the sites training at once with "
                "concurrency instead"
            )
        if self.network:
            self.load_network()  # a bad preset name or profile file fails here, early
        elif self.compute_model or self.step_seconds:
            raise ConfigError(
                "compute-model and step-seconds shape a simulated network's compute times: "
                "also set network (a preset such as world, or a profile .toml)"
            )
        _check_model(self.model)
        _one_of("partition", self.partition, PARTITIONS)
        if self.partition == "files":
            if self.dataset in BUILTIN_DATASETS or self.dataset.endswith(".npz"):
                raise ConfigError(
                    "partition 'files' reads one file per site: set dataset to the directory "
                    "written by `flplatform data split` (it holds manifest.json)"
                )
        elif self.dataset not in BUILTIN_DATASETS and not self.dataset.endswith(".npz"):
            raise ConfigError(
                f"unknown dataset '{self.dataset}'; allowed: {', '.join(BUILTIN_DATASETS)}"
                " or a path to a .npz file with arrays x and y"
            )
        _positive("num-server-rounds", self.num_server_rounds)
        _positive("batch-size", self.batch_size)
        if self.local_steps < 0 or self.local_epochs < 0:
            raise ConfigError("local-steps and local-epochs must be >= 0")
        if self.local_steps == 0 and self.local_epochs == 0:
            raise ConfigError("set local-steps (H > 0) or local-epochs (E > 0); both are 0")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"alpha must be a finite number > 0, got {self.alpha}")
        _positive("lr", self.lr)
        _positive("server-lr", self.server_lr)
        _unit_interval("momentum", self.momentum)
        _unit_interval("server-momentum", self.server_momentum)
        if not (0.0 < self.fraction_train <= 1.0):
            raise ConfigError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        if not (0.0 <= self.fraction_evaluate <= 1.0):
            raise ConfigError(f"fraction-evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if not self.sites:
            raise ConfigError("sites must name at least one site")
        if self.min_sites < 0:
            raise ConfigError(f"min-sites must be >= 0, got {self.min_sites}")
        _positive("round-timeout", self.round_timeout)
        if self.round_timeout > MAX_ROUND_TIMEOUT:
            raise ConfigError(
                f"round-timeout must be at most {MAX_ROUND_TIMEOUT:.0f} s (7 days), "
                f"got {self.round_timeout}"
            )
        if self.max_failed_rounds < 0:
            raise ConfigError(
                "max-failed-rounds must be >= 0 (rounds in a row that fail alike before the "
                f"run stops; 0 never stops), got {self.max_failed_rounds}"
            )

    def _validate_sketch(self) -> None:
        # Which options shape which sketched strategy's messages.
        owners = {
            "sketch_rows": SKETCHED,
            "sketch_cols": SKETCHED,
            "sketch_removal": (FETCHSGD,),
            "candidate_factor": (SKETCHED_SGD,),
        }
        for name, strategies in owners.items():
            if self.strategy not in strategies and getattr(self, name) != getattr(RunConfig, name):
                raise ConfigError(
                    f"{name.replace('_', '-')} shapes the sketches of strategy "
                    f"{' and '.join(repr(s) for s in strategies)}, not '{self.strategy}'"
                )
        if self.strategy not in SKETCHED:
            return
        sketched_sync_only(self.strategy).check(self.sync)
        if self.k < 1:
            raise ConfigError(f"k (coordinates applied per step) must be >= 1, got {self.k}")
        if self.sketch_rows < 1 or self.sketch_rows % 2 == 0:
            raise ConfigError(f"sketch-rows must be odd and >= 1, got {self.sketch_rows}")
        if self.sketch_cols < 0:
            raise ConfigError(f"sketch-cols must be >= 0 (0: 5·k), got {self.sketch_cols}")
        _one_of("sketch-removal", self.sketch_removal, ("zero", "subtract"))
        if self.candidate_factor < 1:
            raise ConfigError(
                f"candidate-factor P must be >= 1 (the values round asks for P·k "
                f"coordinates), got {self.candidate_factor}"
            )

    def _validate_delayed(self) -> None:
        if self.strategy != DELAYED:
            changed = [
                name
                for name in ("delay", "period", "compensation")
                if getattr(self, name) != getattr(RunConfig, name)  # the class default
            ]
            if changed:
                raise ConfigError(
                    f"{', '.join(changed)} shape delayed compensated updates: use them with "
                    f"strategy 'delayed', not '{self.strategy}'"
                )
            return
        if self.delay < 0:
            raise ConfigError(f"delay must be an integer >= 0 rounds, got {self.delay}")
        if self.period < 0:
            raise ConfigError(
                f"period must be >= 0 local steps (0: use local-steps), got {self.period}"
            )
        DELAYED_SYNC_ONLY.check(self.sync)
        if self.server_momentum != 0.0:
            raise ConfigError(
                "strategy 'delayed' applies each average with server-lr and no server "
                "momentum (sites swap in x_0 + Σ server-lr·Ā exactly); set server-momentum 0"
            )
        if self.fraction_train != 1.0:
            raise ConfigError(
                "strategy 'delayed' trains every site every period; fraction-train must be 1"
            )

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
    def num_sites(self) -> int:
        """Number of named sites (one simulated SuperNode each)."""
        return len(self.sites)

    @property
    def required_sites(self) -> int:
        """Nodes that must be connected before the first round starts."""
        return self.min_sites or self.num_sites


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


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} '{value}'; allowed: {', '.join(allowed)}")


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be > 0, got {value}")


def _unit_interval(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise ConfigError(f"{name} must be in [0, 1), got {value}")


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


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _as_names(name: str, value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    names = tuple(str(item).strip() for item in items if str(item).strip())
    for site in names:
        if not _SITE_NAME.match(site):
            raise ConfigError(
                f"bad site name '{site}' in {name}; use letters, digits, '_', '.', '-' (max 64)"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"{name} has duplicate names: {', '.join(names)}")
    return names
