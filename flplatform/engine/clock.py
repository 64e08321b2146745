"""Clocks the engine reads time from.

In deployment the wall clock orders arrivals. A virtual clock driven by site profiles
(latency, bandwidth, compute model) plugs in behind the same interface: the engine stamps
every dispatch and arrival through it and processes arrivals in clock order, so a 2-core
machine can reproduce a federation spanning continents.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol


class Clock(Protocol):
    """What the engine needs from a clock."""

    def now(self) -> float:
        """Current time in seconds (virtual or wall)."""
        ...

    def arrival_time(
        self,
        *,
        site: str,
        dispatched_at: float,
        bytes_down: int,
        bytes_up: int,
        compute_seconds: float | None,
    ) -> float:
        """When a reply dispatched at ``dispatched_at`` counts as arrived on this clock."""
        ...

    def releasable(self, arrived_at: float, in_flight: Mapping[int, Any]) -> bool:
        """Whether the earliest queued arrival may be judged now.

        A virtual clock says no while a message still in flight could land earlier;
        the wall clock always says yes: what has been pulled has arrived.
        """
        ...


class WallClock:
    """Real time: a reply has arrived when the server pulls it."""

    def now(self) -> float:
        """Seconds since the epoch."""
        return time.time()

    def arrival_time(
        self,
        *,
        site: str,
        dispatched_at: float,
        bytes_down: int,
        bytes_up: int,
        compute_seconds: float | None,
    ) -> float:
        """The moment the reply was pulled."""
        return time.time()

    def releasable(self, arrived_at: float, in_flight: Mapping[int, Any]) -> bool:
        """Always: on the wall clock, whatever has been pulled has arrived."""
        return True
