"""Small helpers shared by the network modules: type checks and message formatting."""

from __future__ import annotations

from typing import Any


def is_number(value: Any) -> bool:
    """True for an int or float; bool is an int subclass, but ``speed = true`` is a mistake."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def fmt(value: Any) -> str:
    """Render a value for an error message: numbers compactly, anything else quoted."""
    return f"{value:g}" if is_number(value) else repr(value)
