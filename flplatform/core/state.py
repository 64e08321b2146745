"""Reading a strategy's saved server state back: every problem collected, node ids remapped.

A strategy's ``state_dict()`` is plain checkpoint data (``flplatform.core.checkpoint``); its
``load_state_dict(state, nodes=...)`` reads it with a ``StateReader``, which checks each
value where it is read and notes what is wrong instead of raising, so one
``CheckpointError`` lists every problem (Opacus' validators). Values are parsed into new
objects and assigned only once nothing is wrong: a refused state leaves the strategy as
it was.

Node ids: a resumed simulation's sites join with new Flower node ids; ``nodes`` maps the
ids the state names to this run's (None: the same ids). An id the map lacks is a problem:
the strategy would otherwise keep bookkeeping for a site it can never hear from again.

Pure NumPy; imports no Flower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from flplatform.core.checkpoint import StateProblems

T = TypeVar("T")
# A field the state lacks: noted once by ``fields``; every read of it then yields None quietly,
# so the other fields are still checked and every problem is reported together.
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()


class StateReader:
    """Typed reads of a saved state tree, noting problems in ``problems``.

    Each read returns the parsed value, or None (a problem noted) when it is unusable.
    """

    def __init__(self, owner: str, nodes: Mapping[int, int] | None = None) -> None:
        self.problems = StateProblems(owner)
        self.nodes = nodes

    # ------------------------------------------------------------ plumbing
    def add(self, problem: str) -> None:
        self.problems.add(problem)

    def raise_if_any(self) -> None:
        self.problems.raise_if_any()

    def fields(self, state: Any, where: str, *names: str) -> dict[str, Any] | None:
        """``state``'s ``names`` (a missing one noted, and ``MISSING``); None if no mapping."""
        if state is MISSING:
            return None
        if not isinstance(state, Mapping):
            self.add(f"'{where or 'state'}' must be a mapping, got {type(state).__name__}")
            return None
        for name in names:
            if name not in state:
                self.add(f"'{_join(where, name)}' is missing")
        unknown = [n for n in state if n not in names]
        if unknown:
            self.add(f"'{where or 'state'}' holds unknown entries {sorted(map(str, unknown))}")
        return {name: state.get(name, MISSING) for name in names}

    # ------------------------------------------------------------ scalars
    def integer(self, value: Any, where: str, *, minimum: int | None = None) -> int | None:
        if value is MISSING:
            return None
        if isinstance(value, np.integer):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(f"'{where}' must be a whole number, got {value!r:.60}")
            return None
        if minimum is not None and value < minimum:
            self.add(f"'{where}' must be >= {minimum}, got {value}")
            return None
        return value

    def real(self, value: Any, where: str, *, minimum: float | None = None) -> float | None:
        """A finite number, kept as the int or float it was (sums stay bit for bit)."""
        if value is MISSING:
            return None
        if isinstance(value, np.floating | np.integer):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.add(f"'{where}' must be a number, got {value!r:.60}")
            return None
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            bound = "" if minimum is None else f" >= {minimum}"
            self.add(f"'{where}' must be a finite number{bound}, got {value!r}")
            return None
        return value

    def node(self, value: Any, where: str) -> int | None:
        """A saved node id, mapped to this run's."""
        node = self.integer(value, where)
        if node is None or self.nodes is None:
            return node
        if node not in self.nodes:
            self.add(f"'{where}' names node {node}, which the node map does not hold")
            return None
        return self.nodes[node]

    # ------------------------------------------------------------ containers
    def keyed(
        self,
        value: Any,
        where: str,
        read_value: Callable[[Any, str], T | None],
        *,
        by_node: bool = False,
    ) -> dict[int, T] | None:
        """A dict with integer keys (node ids when ``by_node``: remapped)."""
        if value is MISSING:
            return None
        if not isinstance(value, Mapping):
            self.add(f"'{where}' must be a mapping, got {type(value).__name__}")
            return None
        out: dict[int, T] = {}
        ok = True
        for key, item in value.items():
            at = f"{where}[{key!r}]"
            parsed_key = self.node(key, f"{where} key") if by_node else self.integer(key, at)
            parsed = read_value(item, at)
            if parsed_key is None or parsed is None:
                ok = False
                continue
            if parsed_key in out:
                self.add(f"'{where}' maps two nodes to node {parsed_key}")
                ok = False
            out[parsed_key] = parsed
        return out if ok else None

    def integers(self, value: Any, where: str) -> set[int] | None:
        """A set of whole numbers (periods, versions)."""
        if value is MISSING:
            return None
        if not isinstance(value, set | frozenset | list | tuple):
            self.add(f"'{where}' must be a set of whole numbers, got {type(value).__name__}")
            return None
        parsed = [self.integer(v, f"{where} item") for v in value]
        return None if any(p is None for p in parsed) else {p for p in parsed if p is not None}

    def node_set(self, value: Any, where: str) -> set[int] | None:
        """A set of node ids, remapped."""
        if value is MISSING:
            return None
        if not isinstance(value, set | frozenset | list | tuple):
            self.add(f"'{where}' must be a set of node ids, got {type(value).__name__}")
            return None
        parsed = [self.node(v, f"{where} item") for v in value]
        return None if any(p is None for p in parsed) else {p for p in parsed if p is not None}

    # ------------------------------------------------------------ arrays
    def array(
        self,
        value: Any,
        where: str,
        *,
        shape: tuple[int, ...] | None = None,
        dtype: Any = None,
        finite: bool = False,
    ) -> np.ndarray | None:
        if value is MISSING:
            return None
        if not self.problems.array(value, where, shape=shape, dtype=dtype):
            return None
        if finite and value.dtype.kind in "fc" and not np.isfinite(value).all():
            self.add(f"'{where}' holds NaN or Inf")
            return None
        return np.array(value, copy=True)

    def indices(self, value: Any, where: str, *, d: int | None) -> np.ndarray | None:
        """A 1-D int64 array of coordinates in [0, d)."""
        array = self.array(value, where, dtype=np.int64)
        if array is None:
            return None
        if array.ndim != 1:
            self.add(f"'{where}' must be 1-D, got shape {array.shape}")
            return None
        if d is not None and len(array) and (array.min() < 0 or array.max() >= d):
            self.add(f"'{where}' holds coordinates outside [0, {d})")
            return None
        return array

    def arrays(
        self,
        value: Any,
        where: str,
        *,
        like: Mapping[str, np.ndarray] | None,
        dtype: Any = np.float64,
    ) -> dict[str, np.ndarray] | None:
        """Name → finite array of ``dtype``; the names and shapes of ``like`` when given."""
        if value is MISSING:
            return None
        if not isinstance(value, Mapping):
            self.add(f"'{where}' must be a mapping of arrays, got {type(value).__name__}")
            return None
        if like is not None and list(value) != list(like):
            self.add(
                f"'{where}' holds arrays {list(value)[:6]}, this run's model has {list(like)[:6]}"
            )
            return None
        out = {}
        for name, array in value.items():
            shape = None if like is None else tuple(np.shape(like[name]))
            parsed = self.array(array, f"{where}.{name}", shape=shape, dtype=dtype, finite=True)
            if parsed is None:
                return None
            out[str(name)] = parsed
        return out


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
