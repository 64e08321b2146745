"""``start()``'s options that are plain data, their checks, and ``FLPLATFORM_OPTIONS``.

``flplatform run APP_DIR --network world --sync k-async`` hands its options to the ServerApp
process in the environment variable ``FLPLATFORM_OPTIONS``, a JSON object of ``start()``
keyword names and values (build it with :func:`options_environment`). They override the
keyword arguments the ServerApp's code passed (:func:`resolve_options`). Every option is
checked by one rule of :mod:`flplatform.core.checks`, wherever it comes from; an unknown name or
a bad value is a ``ConfigError`` naming it, all of them in one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from flplatform.core.checks import Problem, holds, integer, number, require
from flplatform.core.errors import ConfigError
from flplatform.engine.guard import GUARD_OPTIONS, GuardOptions, guard_problems
from flplatform.engine.stop_rule import DEFAULT_MAX_FAILED_ROUNDS
from flplatform.engine.synchrony import SYNC_MODES
from flplatform.network import Network

# The environment variable through which ``flplatform run`` passes its options.
OPTIONS_ENV = "FLPLATFORM_OPTIONS"
# A run-config value, as Flower's run config holds it.
ConfigValue = str | int | float | bool


_GUARD = GuardOptions()  # the guard's own defaults


@dataclass(frozen=True)
class PlatformOptions:
    """The keyword arguments of ``start`` that are plain data (and may come from the CLI).

    Their meaning is documented on ``start``. Every default is said here, once:
    ``start``'s signature, the ledger, and the run options' table (``RunConfig``) take
    theirs from :data:`DEFAULT_OPTIONS`.
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
    max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS
    update_norm_ratio: float = _GUARD.norm_ratio
    update_norm_action: str = _GUARD.norm_action
    max_site_share: float = _GUARD.max_share
    reject_replays: bool = _GUARD.reject_replays
    update_min_cosine: float = _GUARD.min_cosine
    # Cross-silo rounds are long (minutes): a kept model every 5 rounds costs little disk,
    # and the last 3 of them are what a user compares or rolls back to.
    checkpoint_every: int = 5
    keep_checkpoints: int = 3
    checkpoint_dir: str | None = None
    resume_run: int | None = None
    # How the run was launched (``flplatform run`` sets it: the app directory and the
    # options given), recorded with the run so that ``flplatform resume`` can launch it again.
    launched_by: Mapping[str, Any] | None = None


DEFAULT_OPTIONS = PlatformOptions()
OPTION_NAMES = tuple(f.name for f in fields(PlatformOptions))


def resolve_options(given: PlatformOptions) -> tuple[PlatformOptions, dict[str, Any]]:
    """The options to run with: ``given`` (checked) overridden by ``FLPLATFORM_OPTIONS``.

    Returns the options and the overrides that applied.
    """
    _checked({n: getattr(given, n) for n in OPTION_NAMES}, source="start()")
    overrides = options_from_environment()
    return replace(given, **overrides), overrides


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


def option_problem(option: str, value: Any, label: str) -> Problem:
    """What is wrong with ``value`` for ``start()``'s ``option``, said of ``label``.

    The one rule per option, for callers that name options their own way (the CLI's
    ``--rounds`` for ``num_rounds``).
    """
    if _unset_or_object(option, value, objects=False):
        return None
    return _RULES[option](value, label)


def _checked(values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """``values`` (names in snake- or kebab-case) checked, by snake-case name.

    Raises one ``ConfigError`` naming every bad value and every unknown name.
    """
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    unknown = []
    for raw, value in values.items():
        option = str(raw).replace("-", "_")
        if option not in OPTION_NAMES:
            unknown.append(str(raw))
            continue
        if not _unset_or_object(option, value, objects=source == "start()"):
            problems.append(_RULES[option](value, f"{source}: option '{option}'"))
        out[option] = value
    if unknown:
        problems.append(
            f"{source}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) for u in unknown)}; allowed: {', '.join(OPTION_NAMES)}"
        )
    require(problems)
    return out


def _unset_or_object(option: str, value: Any, *, objects: bool) -> bool:
    """Whether ``value`` needs no rule: None for an option that may be unset, or a Network.

    ``objects``: whether values that JSON cannot carry (a ``Network``) are allowed.
    """
    if value is None and option in _NULLABLE:
        return True
    return option == "network" and objects and isinstance(value, Network)


# ====================================================================== the rules
def _text(says: str) -> Callable[[Any, str], Problem]:
    return lambda value, name: holds(isinstance(value, str), value, name, says=says)


def _text_keys(value: Any, name: str) -> Problem:
    ok = isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    return holds(ok, value, name, says="an object with text keys or null")


def _guard_rule(option: str) -> Callable[[Any, str], Problem]:
    """The guard's own rule for one of its options, reported under ``name``."""

    def rule(value: Any, name: str) -> Problem:
        said = [problem for problem in guard_problems(**{option: value}) if problem]
        return f"{name}: {said[0]}" if said else None

    return rule


# Each option's rule: ``rule(value, name)`` is what is wrong with ``value``, or None.
_RULES: dict[str, Callable[[Any, str], Problem]] = {
    "num_rounds": lambda v, n: integer(v, n, minimum=1),
    "timeout": lambda v, n: number(v, n, above=0, says="a number of seconds > 0"),
    "sync": lambda v, n: holds(v in SYNC_MODES, v, n, says=f"one of {', '.join(SYNC_MODES)}"),
    "k": lambda v, n: integer(v, n, minimum=1),
    "staleness_bound": lambda v, n: integer(
        v, n, minimum=0, says="an integer >= 0 or null (no bound)"
    ),
    "staleness_weighting": _text("a weighting name or null"),
    "staleness_step_c": lambda v, n: number(v, n, above=0, says="a number > 0"),
    "adasync": lambda v, n: holds(isinstance(v, bool), v, n, says="true or false"),
    "concurrency": lambda v, n: integer(v, n, minimum=0, says="an integer >= 0 (0: every site)"),
    "network": _text("a preset name, a .toml path or null"),
    "compute_model": _text("a compute model name (or empty)"),
    "step_seconds": lambda v, n: number(
        v, n, at_least=0, says="a number >= 0 (0: keep the profiles')"
    ),
    "seed": lambda v, n: integer(v, n, minimum=0),
    "ledger": _text("a database URL, 'default' or null (no ledger)"),
    "name": _text("a text or null"),
    "run_config": _text_keys,
    "tag": _text("a text or null"),
    "required_sites": lambda v, n: integer(v, n, minimum=0),
    "max_failed_rounds": lambda v, n: integer(
        v, n, minimum=0, says="an integer >= 0 (0: never stop)"
    ),
    "checkpoint_every": lambda v, n: integer(
        v, n, minimum=0, says="an integer >= 0 (0: keep only the final model)"
    ),
    "keep_checkpoints": lambda v, n: integer(v, n, minimum=1),
    "checkpoint_dir": _text("a directory path or null ($FLPLATFORM_HOME/checkpoints)"),
    "resume_run": lambda v, n: integer(v, n, minimum=1, says="a run id >= 1 or null"),
    "launched_by": _text_keys,
    # The guard's options: its own rules, under the name the caller used.
    **{option: _guard_rule(option) for option in GUARD_OPTIONS},
}
# Options that may be None (JSON null): "not set" (no bound, no network, no ledger, ...).
_NULLABLE = frozenset(
    (
        "staleness_bound",
        "staleness_weighting",
        "network",
        "ledger",
        "name",
        "run_config",
        "tag",
        "checkpoint_dir",
        "resume_run",
        "launched_by",
    )
)
