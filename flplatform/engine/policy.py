"""Aggregation policies: when to dispatch, what to do with an arrival, when to aggregate.

A policy sees the engine's state through ``EngineView`` and answers four questions: who
may get work, what to do with an arrival, when to aggregate, whom to cancel. The fully
synchronous barrier is one answer among several that plug into the same engine (see
``flplatform.engine.synchrony``): K-sync, K-async, buffered (FedBuff) and, later, delayed
updates answer the same questions differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from flplatform.engine.events import Dispatch


@dataclass(frozen=True)
class EngineView:
    """A read-only snapshot of the engine's scheduling state."""

    server_round: int
    model_version: int
    idle_nodes: tuple[int, ...]  # connected, with no message of any kind outstanding
    # node id → its training message, in flight or arrived but not yet judged
    outstanding: Mapping[int, Dispatch]
    dispatched_this_round: int
    arrived_this_round: int  # outcomes of any status so far this round
    applied_this_round: int  # updates the strategy accumulated this round
    applied_nodes: frozenset[int]  # the sites those updates came from (K different sites)
    connected_nodes: int  # P: sites the SuperLink lists now
    # sites whose update this round was dropped or rejected: not offered work again this round
    failed_nodes: frozenset[int] = frozenset()
    # sites sitting work out (simulated availability) that will come back
    away_nodes: frozenset[int] = frozenset()
    # ‖x_current − x_version‖² for a version still in use (the staleness-aware step size)
    model_distance: Callable[[int], float] = field(default=lambda version: 0.0)
    # Pipelined policies: messages sent so far for this round's period (in any round),
    # and the periods of the messages still outstanding.
    sent_for_round: int = 0
    periods_outstanding: frozenset[int] = frozenset()
    # Of the applied updates, those the update guard holds until it can judge them (no
    # norm reference yet: the run's first updates), and their sites. They count toward K
    # only once judged, or when nothing more can come.
    held_this_round: int = 0
    held_nodes: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Verdict:
    """What to do with a well-formed arrival.

    APPLIED hands the update to the strategy's accumulator; buffering (FedBuff) is
    applying into the accumulator while ``ready_to_aggregate`` waits for K of them.
    Anything else (DROPPED, CANCELLED) is recorded and not used.
    """

    status: str
    reason: str | None = None
    # Multiplies the update's example weight in Σ w·s·Δ / Σ w (staleness weighting); the
    # denominator keeps the unscaled weights so a discount really shrinks the step.
    weight_scale: float = 1.0


class AggregationPolicy(Protocol):
    """The scheduling decisions of one synchrony mode."""

    name: str
    # True: a site may start work for a later round before this one is aggregated, and
    # on a virtual clock its next computation starts when its previous one ends and
    # the model it was sent has arrived (its upload and download overlap computation).
    pipelined: bool

    def sites_problem(self, num_sites: int) -> str | None:
        """Why the mode can never be honoured with ``num_sites`` sites (K beyond them)."""
        ...

    def dispatch_targets(self, view: EngineView) -> tuple[int, ...]:
        """Nodes that may be given work now; the strategy samples among them."""
        ...

    def judge(self, dispatch: Dispatch, view: EngineView) -> Verdict:
        """Apply, buffer or drop an update that arrived well-formed."""
        ...

    def ready_to_aggregate(self, view: EngineView) -> bool:
        """Whether the arrivals so far are aggregated into a new model version now."""
        ...

    def to_cancel(self, view: EngineView) -> tuple[int, ...]:
        """Nodes whose outstanding work is cancelled now (stragglers of a K-sync step)."""
        ...

    def round_finished(self, train_loss: float | None) -> None:
        """Learn from the step that just closed (AdaSync grows K as the loss falls)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the policy learned so far, as checkpoint data (not its options)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output; ``CheckpointError`` for one of another mode."""
        ...
