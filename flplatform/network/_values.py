"""Small helpers shared by the network modules: type checks, units and message formatting."""

from __future__ import annotations

from typing import Any


def is_number(value: Any) -> bool:
    """True for an int or float; bool is an int subclass, but ``speed = true`` is a mistake."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def fmt(value: Any) -> str:
    """Render a value for an error message: numbers compactly, anything else quoted."""
    return f"{value:g}" if is_number(value) else repr(value)


# Unit conversions in one place, so presets and files give bit-identical floats.
def ms_to_seconds(ms: float) -> float:
    """Milliseconds (the TOML's ``rtt_ms``) as seconds."""
    return ms / 1000.0


def mbps_to_bps(mbps: float) -> float:
    """Mbit/s (10^6 bit/s, the TOML's ``*_mbps``) as bit/s."""
    return mbps * 1e6


def problem_line(subject: str, problems: list[str]) -> str:
    """One line listing every problem; numbered, since messages contain ';' themselves."""
    n = len(problems)
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return f"{subject} has {n} problem{'s' if n != 1 else ''}: {listed}"
