"""One family of argument checks, shared by the run configuration, strategies, maths and sites.

A *rule* returns what is wrong with one value, as one line naming the argument, the value
and what is allowed, or ``None`` when nothing is. Callers gather the problems of all their
arguments and raise them together with :func:`require` (Opacus' validators are the model: a
user sees every problem at once, not one per attempt). The ``check_*`` helpers are the
one-argument form that returns the value, for plain functions' arguments.

Pure Python, importing no Flower, torch or numpy: sites and maths modules use it too.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flplatform.core.errors import ConfigError

Problem = str | None

# numpy's SeedSequence and torch.manual_seed both accept any non-negative integer below 2**63;
# a single bound keeps a seed valid for every consumer it is handed to.
MAX_SEED = 2**63 - 1
# A site's name: it names a SuperNode, a ledger row and (deployed) a data file.
SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SITE_NAME_RULE = "use letters, digits, '_', '.', '-' (max 64)"


def require(*problems: Problem | Iterable[Problem]) -> None:
    """Raise one ``ConfigError`` naming every problem given (``None`` entries are fine)."""
    found: list[str] = []
    for item in problems:
        if isinstance(item, str):
            found.append(item)
        elif item is not None:
            found.extend(p for p in item if p)
    if found:
        raise ConfigError(
            found[0] if len(found) == 1 else f"{len(found)} problems: " + "; ".join(found)
        )


# ------------------------------------------------------------------------------- rules
def is_integer(value: object) -> bool:
    """An integer that is not a ``bool`` (``True`` as a count is always a mistake)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def is_number(value: object) -> bool:
    """A finite real number that is not a ``bool``."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(float(value))
    )


def integer(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    says: str = "",
) -> Problem:
    """``value`` must be an integer in ``minimum..maximum``; ``says`` words what is allowed."""
    ok = is_integer(value) and (
        (minimum is None or int(value) >= minimum)  # type: ignore[call-overload]
        and (maximum is None or int(value) <= maximum)  # type: ignore[call-overload]
    )
    if ok:
        return None
    if not says:
        if maximum is None:
            says = "an integer" if minimum is None else f"an integer >= {minimum}"
        else:
            says = f"an integer in {minimum}..{maximum}"
    return f"{name} must be {says}, got {_shown(value)}"


def number(
    value: object,
    name: str,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    says: str = "",
) -> Problem:
    """``value`` must be a finite number within the bounds given (strict: above, below)."""
    ok = is_number(value)
    if ok:
        x = float(value)  # type: ignore[arg-type]
        ok = (
            (above is None or x > above)
            and (at_least is None or x >= at_least)
            and (below is None or x < below)
            and (at_most is None or x <= at_most)
        )
    if ok:
        return None
    return f"{name} must be {says or _bounds(above, at_least, below, at_most)}, got {_shown(value)}"


def positive(value: object, name: str, *, says: str = "> 0") -> Problem:
    """``value`` must be a finite number > 0."""
    return number(value, name, above=0.0, says=says)


def unit_interval(value: object, name: str, *, says: str = "") -> Problem:
    """``value`` must be in [0, 1): a momentum or a decay."""
    return number(value, name, at_least=0.0, below=1.0, says=says)


def holds(ok: bool, value: object, name: str, *, says: str) -> Problem:
    """``value`` must pass a test of the caller's (``ok``); ``says`` words what is allowed."""
    return None if ok else f"{name} must be {says}, got {_shown(value)}"


def one_of(value: object, name: str, allowed: Sequence[str], *, also: str = "") -> Problem:
    """``value`` must be one of ``allowed`` (``also`` words further forms that are allowed)."""
    if value in allowed:
        return None
    return f"unknown {name} '{value}'; allowed: {', '.join(allowed)}{also}"


def odd(value: object, name: str) -> Problem:
    """``value`` must be an odd integer >= 1 (a median over rows needs one middle row)."""
    if is_integer(value) and int(value) >= 1 and int(value) % 2 == 1:  # type: ignore[call-overload]
        return None
    return f"{name} must be odd and >= 1, got {_shown(value)}"


def site_names(names: Sequence[str], name: str) -> list[str]:
    """Every problem with a list of site names: bad characters, duplicates."""
    problems = [
        f"bad site name '{site}' in {name}; {SITE_NAME_RULE}"
        for site in names
        if not SITE_NAME.fullmatch(site)
    ]
    problems += [
        f"site name '{site}' in {name} is only digits, which reads as a count of sites: "
        "give the name a letter"
        for site in names
        if site.isdecimal()
    ]
    if len(set(names)) != len(names):
        problems.append(f"{name} has duplicate names: {', '.join(names)}")
    return problems


# ----------------------------------------------- one argument, checked, returned
def check_seed(seed: object, *, name: str = "seed") -> int:
    """``seed`` as an ``int`` in ``0..2**63-1``, else ``ConfigError``."""
    require(integer(seed, name, minimum=0, maximum=MAX_SEED))
    return int(seed)  # type: ignore[call-overload]


def check_int(value: object, *, name: str, minimum: int) -> int:
    """``value`` as an ``int >= minimum``, else ``ConfigError``."""
    require(integer(value, name, minimum=minimum))
    return int(value)  # type: ignore[call-overload]


def check_fraction(value: object, *, name: str) -> float:
    """``value`` as a ``float`` strictly between 0 and 1, else ``ConfigError``."""
    require(number(value, name, above=0.0, below=1.0, says="a number strictly between 0 and 1"))
    return float(value)  # type: ignore[arg-type]


def check_positive(value: object, *, name: str) -> float:
    """``value`` as a finite ``float > 0``, else ``ConfigError``."""
    require(positive(value, name, says="a finite number > 0"))
    return float(value)  # type: ignore[arg-type]


def positive_count(value: object) -> int:
    """``value`` as a positive ``int`` when it is a finite number > 0, else 0 (not given).

    For values a component may read without requiring them (a round config's optional keys).
    """
    return int(value) if positive(value, "") is None else 0  # type: ignore[call-overload]


# ---------------------------------------------------------------------- wording
def _bounds(
    above: float | None, at_least: float | None, below: float | None, at_most: float | None
) -> str:
    low = above if above is not None else at_least
    high = below if below is not None else at_most
    if low is not None and high is not None:
        left = "(" if above is not None else "["
        right = ")" if below is not None else "]"
        return f"in {left}{_num(low)}, {_num(high)}{right}"
    if low is not None:
        return f"{'>' if above is not None else '>='} {_num(low)}"
    if high is not None:
        return f"{'<' if below is not None else '<='} {_num(high)}"
    return "a finite number"


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _shown(value: object) -> str:
    return str(value) if is_number(value) else repr(value)


def as_bool(value: object, name: str) -> bool:
    """``value`` as a yes/no: a bool, or true/false, yes/no, on/off, 1/0 in any case.

    Run configs carry bools from TOML and text from ``-c key=value``; both mean the same.
    Raises ``ConfigError`` naming ``name`` for anything else.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class SyncOnly:
    """A strategy that runs with sync mode ``sync`` only, and why: its pairing, said once.

    The strategy's ``engine_policy`` and the run configuration both ask it; ``sync`` is
    ``flplatform.engine.synchrony``'s fully synchronous mode.

    Parameters
    ----------
    who : str
        The strategy as the error names it (``"strategy 'delayed'"``).
    why : str
        Why the other modes are refused.
    """

    who: str
    why: str

    def problem(self, mode: str) -> str | None:
        """What is wrong with running under ``mode`` (None: nothing)."""
        if mode == "sync":
            return None
        return f"{self.who} runs with sync mode 'sync' only, got {mode!r}: {self.why}"

    def check(self, mode: str) -> None:
        """Refuse any mode but ``sync`` with ``ConfigError``."""
        problem = self.problem(mode)
        if problem is not None:
            raise ConfigError(problem)


# The sites a count names first (the DTS paper's world map), then site-5, site-6, ...
DEFAULT_SITES = ("london", "ohio", "california", "tokyo")


def as_site_names(name: str, value: Any) -> tuple[str, ...]:
    """Site names from a count, a list or comma-separated text; ``ConfigError`` naming every
    bad one. A count n (``4``, ``"100"``) names the first n default sites, then ``site-5``,
    ``site-6``, ...: ``--sites 100`` and the run-config ``sites = 100`` mean 100 sites."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a positive count or a list of names, got {value!r}")
    count = value if isinstance(value, int) else None
    text = value.strip() if isinstance(value, str) else ""
    if text.lstrip("-").isascii() and text.lstrip("-").isdecimal():
        count = int(text)
    if count is not None:
        if count <= 0:
            raise ConfigError(f"{name} must be a positive count or a list of names, got {value}")
        return tuple(
            DEFAULT_SITES[i] if i < len(DEFAULT_SITES) else f"site-{i + 1}" for i in range(count)
        )
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    names = tuple(str(item).strip() for item in items if str(item).strip())
    require(site_names(names, name))
    return names
