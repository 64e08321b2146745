"""What the engine records about each message, and the ledger interface it writes to.

The engine writes through ``LedgerSink``, an interface it is given; it never imports
``storage``. The composition root (``flplatform.server_app``) adapts the SQL repository.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from flplatform.engine.clock import Schedule

APPLIED = "applied"
BUFFERED = "buffered"
CANCELLED = "cancelled"
DROPPED = "dropped"
REJECTED = "rejected"
EVALUATED = "evaluated"  # an evaluation message answered with metrics


@dataclass(frozen=True)
class SiteInfo:
    """A connected site as it introduced itself (or as much as the server could learn)."""

    node_id: int
    name: str
    partition_id: int | None = None
    num_examples: int | None = None
    device: str | None = None


@dataclass
class Dispatch:
    """One training message in flight to one site."""

    node_id: int
    message_id: str  # "" while its push waits for the site's cancelled message to return
    server_round: int  # server step at dispatch
    model_version: int  # version of the global model the site was sent
    dispatched_at: float  # wall time (Unix) of the push
    deadline: float  # time.monotonic() after which the site is overdue
    bytes_down: int
    message_type: str = "train"  # Flower's MessageType: train, evaluate or query
    # the round whose aggregate this update is for: the round open at dispatch, except
    # under a pipelined policy (delayed updates), where a site may work ahead
    period: int = 0
    # declared by the strategy with the period (``Work.delay``): the ledger's delay columns
    delay: int | None = None
    # the clock's plan for this message: clock time of dispatch, earliest arrival, ...
    schedule: Schedule = field(default_factory=lambda: Schedule(dispatched_at=math.nan))


@dataclass(frozen=True)
class UpdateOutcome:
    """What became of one dispatched training message: one ledger row."""

    site: str
    dispatched_round: int
    version_trained_on: int
    staleness: int
    bytes_up: int
    bytes_down: int
    status: str
    dispatched_at: float
    arrived_at: float | None = None
    compute_seconds: float | None = None
    reason: str | None = None
    num_examples: int | None = None
    train_loss: float | None = None
    # Simulated times (seconds since the run's simulated start); None on the wall clock.
    virtual_dispatched_at: float | None = None
    virtual_arrived_at: float | None = None
    virtual_compute_seconds: float | None = None
    transfer_seconds: float | None = None  # simulated download + upload
    # Delayed updates only (None otherwise): the round whose average this update is for,
    # the latest average the site had swapped into its model, and how old that was.
    period: int | None = None
    average_applied: int | None = None
    delay: int | None = None


@dataclass(frozen=True)
class EvaluationOutcome:
    """One federated-evaluation message and its reply: one ledger row."""

    site: str
    model_version: int
    bytes_up: int
    bytes_down: int
    status: str  # EVALUATED or DROPPED
    dispatched_at: float
    arrived_at: float | None = None
    reason: str | None = None
    num_examples: int | None = None
    loss: float | None = None
    accuracy: float | None = None


@dataclass(frozen=True)
class RoundSummary:
    """One server step, as the engine reports it to the ledger and to progress displays."""

    server_round: int
    model_version: int
    started_at: float
    finished_at: float
    metrics: dict[str, float]
    train_loss: float | None
    updates: tuple[UpdateOutcome, ...]
    evaluations: tuple[EvaluationOutcome, ...] = ()
    # Simulated times of the step; None on the wall clock.
    virtual_started_at: float | None = None
    virtual_finished_at: float | None = None

    @property
    def bytes_up(self) -> int:
        """Bytes sites sent for training this round."""
        return sum(u.bytes_up for u in self.updates)

    @property
    def bytes_down(self) -> int:
        """Bytes sent to sites for training this round."""
        return sum(u.bytes_down for u in self.updates)


class LedgerSink(Protocol):
    """Where the engine writes sites and finished rounds (committed round by round)."""

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Record a site that joined the run."""
        ...

    def record_round(self, summary: RoundSummary) -> None:
        """Record one finished round and all its updates, atomically."""
        ...


class NullLedger:
    """A sink that records nothing (for ``strategy.start`` without a database)."""

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Ignore the site."""

    def record_round(self, summary: RoundSummary) -> None:
        """Ignore the round."""
