"""Argument checks shared by the ``clients`` modules.

Each check raises :class:`~flplatform.errors.ConfigError` with one line that names the
argument, the value given and what is allowed, so that callers never ``assert`` on user input.
"""

from __future__ import annotations

import math
import numbers

from flplatform.errors import ConfigError

# numpy's SeedSequence and torch.manual_seed both accept any non-negative integer below 2**63;
# a single bound keeps a seed valid for every consumer it is handed to.
MAX_SEED = 2**63 - 1


def check_seed(seed: object, *, name: str = "seed") -> int:
    """Return ``seed`` as an ``int`` if it is an integer in ``0..2**63-1``.

    Parameters
    ----------
    seed : object
        The value to check; ``bool`` is refused because ``True`` as a seed is always a mistake.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    int
        The seed.

    Raises
    ------
    ConfigError
        If ``seed`` is not an integer in the allowed range.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ConfigError(f"{name} must be an integer in 0..{MAX_SEED}, got {seed!r}")
    if not 0 <= int(seed) <= MAX_SEED:
        raise ConfigError(f"{name} must be an integer in 0..{MAX_SEED}, got {seed}")
    return int(seed)


def check_int(value: object, *, name: str, minimum: int) -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``.

    Parameters
    ----------
    value : object
        The value to check (``bool`` is refused).
    name : str
        The argument's name, for the error message.
    minimum : int
        The smallest allowed value.

    Returns
    -------
    int
        The value.

    Raises
    ------
    ConfigError
        If ``value`` is not an integer or is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_fraction(value: object, *, name: str) -> float:
    """Return ``value`` as a ``float`` if it lies strictly between 0 and 1.

    Parameters
    ----------
    value : object
        The value to check.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    float
        The fraction.

    Raises
    ------
    ConfigError
        If ``value`` is not a real number in the open interval (0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number strictly between 0 and 1, got {value!r}")
    fraction = float(value)
    if not (math.isfinite(fraction) and 0.0 < fraction < 1.0):
        raise ConfigError(f"{name} must be a number strictly between 0 and 1, got {value}")
    return fraction


def check_positive(value: object, *, name: str) -> float:
    """Return ``value`` as a ``float`` if it is finite and strictly positive.

    Parameters
    ----------
    value : object
        The value to check.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    float
        The value.

    Raises
    ------
    ConfigError
        If ``value`` is not a finite real number > 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0.0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value}")
    return number
