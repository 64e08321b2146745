"""Aggregation policies: when to dispatch, what to do with an arrival, when to aggregate.

A policy sees the engine's state through ``EngineView`` and answers three questions. The
fully synchronous barrier is one policy among several that plug into the same engine:
K-sync, K-async, buffered (FedBuff) and delayed updates answer the same questions
differently (wait for the first K, keep stragglers running, buffer, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from flplatform.engine.events import APPLIED, DROPPED, Dispatch


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
        """Nodes whose in-flight work is cancelled once the round's model is out."""
        ...


class SyncPolicy:
    """Fully synchronous rounds: every sampled site once, aggregate when all are back.

    A site that fails, times out or sends a malformed reply is recorded and the round
    closes with the others.
    """

    name = "sync"

    def dispatch_targets(self, view: EngineView) -> tuple[int, ...]:
        """All idle nodes, once, at the start of a round."""
        return view.idle_nodes if view.dispatched_this_round == 0 else ()

    def judge(self, dispatch: Dispatch, view: EngineView) -> Verdict:
        """Apply updates computed on the current version; anything older is late."""
        if dispatch.model_version != view.model_version:
            return Verdict(DROPPED, reason="late: computed on an older model version")
        return Verdict(APPLIED)

    def ready_to_aggregate(self, view: EngineView) -> bool:
        """Once every message dispatched this round is accounted for."""
        return view.dispatched_this_round > 0 and not any(
            d.server_round == view.server_round for d in view.outstanding.values()
        )

    def to_cancel(self, view: EngineView) -> tuple[int, ...]:
        """Nothing: a sync round has no stragglers left when it closes."""
        return ()
