"""The global model's versions still in use: what sites were sent, and when each was formed.

The engine hands versions out and forms new ones; updates arrive trained on older ones. It
keeps a version's arrays while a message trained on it is outstanding (to hand the
strategy the base an update was computed on, and to measure how far the model moved), and
the clock time each version was formed (a pipelined site downloads it from then).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from flplatform.core.arrays import record_to_arrays
from flplatform.core.checkpoint import StateProblems


class ModelVersions:
    """Model versions by number: their arrays while in use, and when they were formed."""

    def __init__(self) -> None:
        self._handed_out: dict[int, ArrayRecord] = {}
        self._formed_at: dict[int, float] = {}
        self._distances: dict[tuple[int, int], float] = {}

    def start(self, now: float) -> None:
        """Version 0 exists from clock time ``now``."""
        self._formed_at = {0: now}

    def formed(self, version: int, now: float) -> None:
        """``version`` was formed at clock time ``now``."""
        self._formed_at[version] = now

    def formed_at(self, version: int, default: float) -> float:
        return self._formed_at.get(version, default)

    def hand_out(self, version: int, arrays: ArrayRecord) -> None:
        """Messages carrying ``version`` are going out: keep its arrays."""
        self._handed_out[version] = arrays

    def base(self, version: int, default: ArrayRecord) -> ArrayRecord:
        """The arrays of ``version`` as handed out (``default`` if the engine never did).

        A strategy that sends older versions than the current one (delayed updates) keeps
        those itself.
        """
        return self._handed_out.get(version, default)

    def prune(self, live: Iterable[int]) -> None:
        """Forget every version but ``live`` ones (outstanding work, and the current one)."""
        keep = set(live)
        self._handed_out = {v: a for v, a in self._handed_out.items() if v in keep}
        self._distances.clear()

    def state_dict(self) -> dict[str, Any]:
        """The arrays of the versions in use, and when every version was formed.

        The arrays are the very records in-flight messages carry, so a checkpoint holds
        each once.
        """
        return {"handed_out": dict(self._handed_out), "formed_at": dict(self._formed_at)}

    def load_state_dict(
        self, state: Mapping[str, Any], *, current: tuple[int, ArrayRecord] | None = None
    ) -> None:
        """Restore ``state_dict()`` output.

        ``current``: the current version and its arrays (the engine's model), kept as
        that same record, as when it was handed out.
        """
        problems = StateProblems("the model versions")
        if not problems.require(state, "handed_out", "formed_at"):
            problems.raise_if_any()
        handed, formed = state["handed_out"], state["formed_at"]
        if not isinstance(handed, Mapping) or not all(
            isinstance(v, int) and isinstance(a, ArrayRecord) for v, a in handed.items()
        ):
            problems.add("'handed_out' must map version numbers to arrays")
        if not isinstance(formed, Mapping) or not all(
            isinstance(v, int) and problems.number(t, f"formed_at[{v}]") for v, t in formed.items()
        ):
            problems.add("'formed_at' must map version numbers to clock times")
        problems.raise_if_any()
        self._handed_out = dict(handed)
        if current is not None and current[0] in self._handed_out:
            self._handed_out[current[0]] = current[1]
        self._formed_at = {v: float(t) for v, t in formed.items()}
        self._distances.clear()

    def distance(self, version: int, *, current: ArrayRecord, current_version: int) -> float:
        """‖x_current − x_version‖², computed once per pair of versions."""
        key = (current_version, version)
        if key not in self._distances:
            base = self._handed_out.get(version)
            if base is None or version == current_version:
                self._distances[key] = 0.0
            else:
                now, then = record_to_arrays(current), record_to_arrays(base)
                self._distances[key] = float(
                    sum(
                        np.sum((now[k].astype(np.float64) - then[k]) ** 2)
                        for k in now
                        if k in then and now[k].shape == then[k].shape
                    )
                )
        return self._distances[key]
