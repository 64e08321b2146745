"""Sweeps: several runs that share one Flower federation (one start-up), each its own run.

``flplatform simulate --sync sync,k-async --seed 1,2`` runs the cartesian product of the
listed values over the other options (:func:`expand`), each combination a run of its own in
the ledger, all of them in one Flower simulation: one SuperLink, one Ray start-up, the same
sites. What the members may share is checked by :func:`check_members`: the sites (one
SuperNode each) and the ledger; anything else may differ.

The members reach the ServerApp as one Flower run config (:func:`sweep_run_config`): the
first member's options, and under ``sweep`` a JSON list of each member's options that
differ from those (its run tag and name always among them). :func:`sweep_members` reads
them back. No Flower imports here.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flplatform.app.config import SKETCHED, RunConfig, option_keys
from flplatform.core.checks import require
from flplatform.core.errors import ConfigError
from flplatform.engine.synchrony import K_MODES
from flplatform.run.options import ConfigValue

# The run-config keys `flplatform simulate` takes lists of.
SWEEPABLE: tuple[str, ...] = ("strategy", "sync", "k", "seed", "codec", "delay")
# Keys every member shares, or that say which run a member is: never swept.
SHARED = ("sites", "min-sites", "db", "run-tag", "name", "sweep", "resume-run")
# The key that holds the members in a Flower run config.
SWEEP_KEY = "sweep"


@dataclass(frozen=True)
class Sweep:
    """The runs of a sweep, and the combinations that cannot run.

    ``members``: each fully validated, each with its own ``name`` (unique). ``skipped``:
    each combination left out (key → value as listed) and why it cannot run.
    """

    members: tuple[RunConfig, ...]
    skipped: tuple[tuple[dict[str, Any], str], ...]


def expand(base: RunConfig, values: Mapping[str, Sequence[Any]]) -> Sweep:
    """The cartesian product of ``values`` over ``base``, in the given key order.

    Parameters
    ----------
    base : RunConfig
        The options every member starts from (its ``name``, if set, leads the members').
    values : mapping
        Run-config key (kebab-case) → the values to run it with, in order. Any option but
        those the members share (sites, ledger, names, tags).

    Returns
    -------
    Sweep
        The members, each named after the base name and its swept values (keys listed
        with several values), e.g. ``local-sgd-digits sync=k-async k=3``; a combination
        ``RunConfig`` refuses (delayed updates in k-async) or one that repeats another (K
        in a mode without K) is skipped with the reason.

    Raises
    ------
    ConfigError
        For an unknown or shared key, an empty or repeated value list, when no combination
        can run, or when a value is refused in every combination.
    """
    return expand_values(base.to_run_config(), values)


def _differ_only_in_k(one: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two combinations differ in ``k`` and nothing else."""
    differ = {key for key in one if one[key] != other.get(key)}
    return differ == {"k"}


def expand_values(base: Mapping[str, Any], values: Mapping[str, Sequence[Any]]) -> Sweep:
    """:func:`expand` over raw run-config values (the CLI's, not yet validated).

    ``base`` need not be valid by itself: only the combinations are checked.
    """
    lists = _checked_lists(values)
    swept = [key for key, listed in lists.items() if len(listed) > 1]
    members: list[RunConfig] = []
    skipped: list[tuple[dict[str, Any], str]] = []
    # what makes a run → the name and the swept values of the first such
    seen: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
    for combination in itertools.product(*lists.values()):
        chosen = dict(zip(lists, combination, strict=True))
        try:
            config = RunConfig.from_mapping({**base, **chosen, SWEEP_KEY: ""})
        except ConfigError as exc:
            skipped.append((chosen, exc.reason))
            continue
        named = _named(config, swept)
        same = _what_runs(named)
        if same in seen:
            first_name, first_choice = seen[same]
            skipped.append(
                (
                    chosen,
                    f"the same run as '{first_name}'"
                    + (
                        f": k shapes only the K modes ({', '.join(K_MODES)}) and the "
                        "sketched strategies"
                        if _differ_only_in_k(chosen, first_choice)
                        else " (the values name the same setting)"
                    ),
                )
            )
            continue
        seen[same] = (named.name, chosen)
        members.append(named)
    _check_coverage(lists, members, skipped)
    check_members(members)
    return Sweep(tuple(members), tuple(skipped))


def check_members(members: Sequence[RunConfig]) -> None:
    """Raise ``ConfigError`` unless ``members`` can share one Flower federation.

    They must have the same sites (names and count: one SuperNode each) and the same
    ledger (``db``), and unique names; none may resume a run or hold a sweep itself.
    """
    if not members:
        raise ConfigError("a sweep needs at least one run")
    first = members[0]
    problems: list[str | None] = []
    for member in members[1:]:
        if member.sites != first.sites:
            problems.append(
                f"run '{member.run_name}' has sites {','.join(member.sites)}, run "
                f"'{first.run_name}' {','.join(first.sites)}: the runs of a sweep share "
                "their sites (one SuperNode each)"
            )
        if member.db != first.db:
            problems.append(
                f"run '{member.run_name}' is recorded in another ledger than run "
                f"'{first.run_name}': the runs of a sweep share their ledger (db)"
            )
    names = [member.run_name for member in members]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        problems.append(f"run names must be unique in a sweep; repeated: {', '.join(repeated)}")
    for member in members:
        if member.resume_run:
            problems.append(
                f"run '{member.run_name}' resumes run {member.resume_run}: a sweep starts "
                "new runs (flplatform resume continues one run)"
            )
        if member.sweep:
            problems.append(f"run '{member.run_name}' holds a sweep of its own")
    require(problems)


# ============================================================ the Flower run config
def sweep_run_config(members: Sequence[RunConfig]) -> dict[str, ConfigValue]:
    """One Flower run config holding every member (:func:`check_members` first).

    The first member's options, and under ``sweep`` a JSON list of each member's options
    that differ from them: its run tag and name always, as the ledger finds it by them.
    """
    check_members(members)
    base = {**members[0].to_run_config(), SWEEP_KEY: ""}
    overrides = []
    for member in members:
        own = member.to_run_config()
        differs = {key: value for key, value in own.items() if base.get(key) != value}
        differs.update({"run-tag": member.run_tag, "name": member.run_name})
        overrides.append(differs)
    return {**base, SWEEP_KEY: json.dumps(overrides, allow_nan=False)}


def sweep_members(run_config: Mapping[str, Any]) -> list[RunConfig]:
    """The members a Flower run config holds under ``sweep`` (empty: it holds none).

    Each member is the run config's options with its own overrides, validated. Keys that
    are not ours (an app's own) are left to the app, as for a single run
    (:func:`sweep_app_keys`).

    Raises
    ------
    ConfigError
        If ``sweep`` is not a JSON list of objects, or a member is not a valid run.
    """
    listed = _listed(run_config)
    if listed is None:
        return []
    members = [
        RunConfig.from_mapping({**run_config, **overrides, SWEEP_KEY: ""}, allow_unknown=True)
        for overrides in listed
    ]
    check_members(members)
    return members


def sweep_app_keys(run_config: Mapping[str, Any]) -> list[dict[str, ConfigValue]]:
    """Each member's own values of the app's keys (those that are not ours), in order.

    ``{"attack.kind": "huge"}`` in a member of the attack app's sweep: its sites read it
    from the member's messages (``clients.site.run_config_of``), as a single run's sites
    read the run config.
    """
    return [
        {key: overrides[key] for key in RunConfig.unknown_keys(overrides)}
        for overrides in _listed(run_config) or []
    ]


def _listed(run_config: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The JSON list of each member's overrides under ``sweep`` (None: no sweep)."""
    text = str(run_config.get(SWEEP_KEY, "")).strip()
    if not text:
        return None
    try:
        listed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"run config '{SWEEP_KEY}' must be a JSON list of each run's options; it is not "
            f"JSON ({exc.msg} at character {exc.pos})"
        ) from None
    if not isinstance(listed, list) or not all(isinstance(item, dict) for item in listed):
        raise ConfigError(
            f"run config '{SWEEP_KEY}' must be a JSON list of objects (each run's options)"
        )
    require(
        f"run config '{SWEEP_KEY}': run {index + 1}'s '{key}' is {type(value).__name__}; "
        "a run-config value is a string, a number or a boolean"
        for index, overrides in enumerate(listed)
        for key, value in overrides.items()
        if not isinstance(value, str | int | float | bool)
    )
    return listed


# ======================================================================= helpers
def _checked_lists(values: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Each key's values, checked: a known, unshared key, at least one value, none twice."""
    known = set(option_keys())
    problems: list[str | None] = []
    lists: dict[str, list[Any]] = {}
    for raw, listed in values.items():
        key = raw.replace("_", "-")
        if key not in known:
            problems.append(f"unknown option '{raw}' to sweep; allowed: {', '.join(SWEEPABLE)}")
            continue
        if key in SHARED:
            problems.append(f"'{key}' cannot be swept: the runs of a sweep share it")
            continue
        items = [listed] if isinstance(listed, str) else list(listed)
        if not items:
            problems.append(f"{key} lists no value")
        repeated = sorted({str(v) for v in items if items.count(v) > 1})
        if repeated:
            problems.append(f"{key} lists {', '.join(repeated)} more than once")
        lists[key] = items
    require(problems)
    return lists


def _named(config: RunConfig, swept: Sequence[str]) -> RunConfig:
    """``config`` named after its base name and its values of the ``swept`` keys."""
    # The default name's strategy would be wrong for every member but one.
    given = config.name or (config.dataset if "strategy" in swept else config.run_name)
    values = config.to_run_config()
    label = " ".join([given, *(f"{key}={values[key]}" for key in swept)])
    return RunConfig.from_mapping({**values, "name": label})


def _what_runs(config: RunConfig) -> tuple[Any, ...]:
    """What makes ``config``'s run: its options but its name, K where K changes nothing."""
    values = config.to_run_config()
    values.pop("name")
    if config.strategy not in SKETCHED:  # theirs counts coordinates
        if config.sync in K_MODES:
            values["k"] = config.sync_k  # k 0 is the default K
        else:
            values.pop("k")
    return tuple(sorted(values.items()))


def _check_coverage(
    lists: Mapping[str, Sequence[Any]],
    members: Sequence[RunConfig],
    skipped: Sequence[tuple[dict[str, Any], str]],
) -> None:
    """``ConfigError`` when no combination runs, or a listed value is in no member."""
    if not members:
        reasons = list(dict.fromkeys(reason for _, reason in skipped))
        raise ConfigError(f"no combination of the sweep can run: {'; '.join(reasons)}")
    problems: list[str | None] = []
    for key, listed in lists.items():
        if len(listed) < 2:
            continue
        meets = math.prod(len(v) for k, v in lists.items() if k != key)  # combinations per value
        for value in listed:
            refusals = [reason for chosen, reason in skipped if chosen[key] == value]
            if len(refusals) == meets:
                problems.append(f"{key} {value} cannot run in any combination: {refusals[0]}")
    require(problems)
